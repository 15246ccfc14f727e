"""The in-container runtime that follows a job's world (no kopf, no operator code)."""
