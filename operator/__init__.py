"""The ringwright operator (kopf): observe, plan purely, apply thinly."""
