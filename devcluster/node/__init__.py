"""Real nodes of the local cluster: a kubelet and containerd per node, running real
containers beside the KWOK nodes (:mod:`ringwright.devcluster.realnode` starts them).

``layout`` names and addresses what a node owns, ``configs`` writes its components'
configuration, ``image`` builds the local image its pods run, ``host`` creates and
removes what lives on the host (processes, namespaces, links, cgroups), and
``registry`` records every set of nodes on the machine and removes a set from its
record, also after a crash.
"""
