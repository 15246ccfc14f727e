"""The steps of one reconcile round, each a pure function of the round's state."""
