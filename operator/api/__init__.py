"""The API users and admins write: TrainingJob, SchedulingPolicy, and the CRDs made from them."""
