"""The observe step: watch caches kept current by kopf, and what one round reads from them."""
