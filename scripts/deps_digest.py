"""Print the cache key of the Python environment.

The key is a digest of what ``pyproject.toml`` asks pip to install (dependencies, extras,
Python bound) and the interpreter's version, so editing anything else in the file (the
package list, tool settings) keeps the multi-GB environment.
"""

import hashlib
import json
import sys
import tomllib

with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
asks = [project["requires-python"], project["dependencies"], project["optional-dependencies"]]
digest = hashlib.sha256(json.dumps(asks, sort_keys=True).encode()).hexdigest()[:12]
print(f"{digest}-py{sys.version_info.major}{sys.version_info.minor}")
