"""A Kubernetes object as the API sends it: a JSON document, held as a dict.

Its own module so that code which only reads or builds objects (the operator's plan
step, the world contract's users) need not import the Kubernetes client.
"""

from typing import Any

Obj = dict[str, Any]
