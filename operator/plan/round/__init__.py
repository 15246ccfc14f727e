"""The steps of one reconcile round: plain functions of what they read (the round, the
status so far) that return what they decide (:class:`.state.Outcome`); the draft
(:mod:`.draft`) records the outcomes in the order ``plan()`` lists the steps."""
