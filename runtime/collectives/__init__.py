"""Collectives: torch.distributed and Horovod behind one interface, and the groups they form."""
