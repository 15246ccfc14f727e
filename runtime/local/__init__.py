"""Running a job without a cluster: real worker processes on loopback addresses."""
