"""``python -m ringwright.devcluster {build,up,down,status,topology,env}``."""

from __future__ import annotations

import argparse
import logging
import sys

from ringwright.kube import api_path

from .build import BuildError
from .build import main as build_main
from .control_plane import Cluster, ClusterError
from .inventory import describe


def main(argv: list[str] | None = None) -> int:
    """Entry point of the local control-plane tool."""
    parser = argparse.ArgumentParser(prog="ringwright-devcluster", description=__doc__)
    parser.add_argument("command", choices=["build", "up", "down", "status", "topology", "env"])
    parser.add_argument("--name", default="ringwright", help="cluster name (state folder)")
    parser.add_argument("--inventory", default="default",
                        help="bundled inventory name or a YAML path (default: default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    cluster = Cluster(args.name)
    try:
        if args.command == "build":
            return build_main()
        elif args.command == "up":
            cluster.up(args.inventory)
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.command == "down":
            cluster.down()
            print(f"cluster {args.name} stopped")
        elif args.command == "status":
            print("running" if cluster.running() else "stopped")
            return 0 if cluster.running() else 1
        elif args.command == "topology":
            with cluster.client() as kube:
                print(describe(kube.list(api_path("v1", "nodes"))))
        elif args.command == "env":
            print(f"export KUBECONFIG={cluster.kubeconfig}")
    except (BuildError, ClusterError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
