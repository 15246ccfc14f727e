"""The plan step: pure decisions from (observed, settings, now) to a Plan. No I/O here."""
