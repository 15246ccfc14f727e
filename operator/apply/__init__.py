"""The apply step: the only code that writes to the Kubernetes API."""
