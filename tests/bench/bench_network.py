"""What topology buys, on an emulated datacenter network (needs root).

Builds racks of worker namespaces under an oversubscribed spine
(:mod:`ringwright.devcluster.netemu`) and, in one run:

1. fits alpha + beta*l to point-to-point transfers inside a rack and across racks;
2. times a gloo ring all-reduce with ranks in ringwright's world order (the operator's
   ``order_ring``), in random order, and in pod-index order (pods spread over the
   racks by index, as a default scheduler spreads them);
3. times the hierarchical all-reduce (rack groups) against the world-ordered flat ring;
4. times training steps: bucketed overlap vs DistributedDataParallel vs the flat
   all-reduce after backward.

Every ratio is against a baseline measured in the same run; the bench exits non-zero
when any measured run fails.

    python tests/bench/bench_network.py [--mbit 50] [--oversubscription 4] [--size-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.devcluster.netemu import (  # noqa: E402
    EmulatedNetwork,
    Host,
    NetworkSpec,
    netem_available,
)
from ringwright.devcluster.netprobe import AlphaBeta, fit_alpha_beta  # noqa: E402
from ringwright.operator.ring import RingSlot, cross_rack_edges, order_ring  # noqa: E402
from ringwright.world import (  # noqa: E402
    HierarchicalAllReduce,
    JobRef,
    Member,
    StoreAddress,
    TopologySettings,
    World,
)

WORKER = ROOT / "tests" / "bench" / "network_worker.py"
PROBE = [sys.executable, "-m", "ringwright.devcluster.netprobe"]
STORE_PORT = 29400
"""Each namespace has its own ports, so a fixed one never clashes."""


class RunFailed(RuntimeError):
    """A measured run did not complete."""


def probe(net: EmulatedNetwork, src: Host, dst: Host) -> AlphaBeta:
    server = subprocess.Popen(net.exec_argv(dst, [*PROBE, "serve", "5200"]))
    try:
        out = subprocess.run(
            net.exec_argv(src, [*PROBE, "send", dst.ip, "5200", "5",
                                "1", "1024", "65536", "262144", "1048576", "4194304"]),
            capture_output=True, text=True, timeout=600, check=False)
        if out.returncode != 0:
            raise RunFailed(f"probe {src.ip} -> {dst.ip}: {out.stderr[-1000:]}")
        server.wait(timeout=30)
    finally:
        server.kill()
    return fit_alpha_beta([(size, t) for size, t in json.loads(out.stdout)])


def pods_spread(hosts: Sequence[Host], racks: int) -> list[Host]:
    """Pod ``i`` on rack ``i % racks``: the hosts in pod-index order."""
    per_rack = [[h for h in hosts if h.rack == r] for r in range(racks)]
    return [per_rack[i % racks][i // racks] for i in range(len(hosts))]


def orders(hosts: Sequence[Host], racks: int, seed: int) -> dict[str, list[Host]]:
    """Ring orders of the same pods: world (the operator's), random, pod index."""
    by_index = pods_spread(hosts, racks)
    slots = [RingSlot(pod=str(i), rack=str(h.rack), node=h.namespace, index=i)
             for i, h in enumerate(by_index)]
    world = [by_index[int(s.pod)] for s in order_ring(slots)]
    shuffled = list(by_index)
    random.Random(seed).shuffle(shuffled)
    return {"world order": world, "random order": shuffled, "pod-index order": by_index}


def world_of(ring: Sequence[Host], mode: HierarchicalAllReduce, epoch: int) -> World:
    members = tuple(Member(rank=i, pod=h.namespace, ip=h.ip, node=h.namespace,
                           rack=f"rack-{h.rack}") for i, h in enumerate(ring))
    return World(job=JobRef(namespace="bench", name="network"), epoch=epoch, members=members,
                 store=StoreAddress(address=members[0].ip, port=STORE_PORT),
                 topology=TopologySettings(hierarchical_all_reduce=mode))


def execute(net: EmulatedNetwork, runs: list[tuple[str, World, dict[str, str]]],
            workdir: Path) -> list[dict[str, float]]:
    """Start one process per host, which forms every run's world in turn (as the
    runtime re-forms groups in place); each run's results."""
    runs_file, out_dir = workdir / "runs.json", workdir / "out"
    out_dir.mkdir(exist_ok=True)
    runs_file.write_text(json.dumps([
        {"task": task, "world": json.loads(world.to_json()), "env": env}
        for task, world, env in runs]))
    base = {**os.environ, "RUNS": str(runs_file), "OUT_DIR": str(out_dir),
            "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [(h, subprocess.Popen(net.exec_argv(h, [sys.executable, str(WORKER)]),
                                  env={**base, "POD": h.namespace}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)) for h in net.hosts]
    failed = []
    for host, proc in procs:
        log, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            failed.append(f"{host.namespace} exit {proc.returncode}: {log.decode()[-1500:]}")
    if failed:
        raise RunFailed("\n".join(failed))
    return [json.loads((out_dir / f"{i}.json").read_text()) for i in range(len(runs))]


def measure(net: EmulatedNetwork, racks: int, args: argparse.Namespace, workdir: Path,
            *, train: bool) -> None:
    rings = orders(net.hosts, racks, seed=args.seed)
    world_ring = rings["world order"]
    reduce_env = {"SIZE_MB": str(args.size_mb), "ITERS": str(args.iters)}
    runs = [("allreduce", world_of(ring, HierarchicalAllReduce.DISABLED, i), reduce_env)
            for i, ring in enumerate(rings.values())]
    runs.append(("allreduce", world_of(world_ring, HierarchicalAllReduce.ENABLED, len(runs)),
                 reduce_env))
    if train:
        runs.append(("train", world_of(world_ring, HierarchicalAllReduce.DISABLED, len(runs)),
                     {"ITERS": str(args.iters), "LAYERS": str(args.layers),
                      "WIDTH": str(args.width), "BATCH": "64"}))
    results = execute(net, runs, workdir)

    names = [*rings, "hierarchical"]
    times = {name: r["seconds"] for name, r in zip(names, results, strict=False)}
    base = times["world order"]
    print(f"{len(net.hosts)} workers on {racks} racks, {args.size_mb:g} MB float32 all-reduce "
          f"(median of {args.iters})")
    print(f"  {'ring':<18} {'cross-rack edges':>16} {'seconds':>9} {'vs world order':>15}")
    for name, seconds in times.items():
        edges = (str(cross_rack_edges([str(h.rack) for h in rings[name]]))
                 if name in rings else "-")
        print(f"  {name:<18} {edges:>16} {seconds:>9.3f} {seconds / base:>14.2f}x")
    print(f"  world order: {times['random order'] / base:.2f}x faster than random order, "
          f"{times['pod-index order'] / base:.2f}x faster than pod-index order; "
          f"hierarchical: {base / times['hierarchical']:.2f}x the speed of the world-ordered "
          "flat ring")
    if train:
        steps = results[-1]
        grads_mb = args.layers * (args.width * args.width + args.width) * 4 / 2**20
        print(f"training step, {grads_mb:.1f} MB of gradients, world order (median of "
              f"{args.iters}, variants interleaved)")
        for name, seconds in steps.items():
            print(f"  {name:<22} {seconds:>8.3f} s {seconds / steps['ddp']:>7.2f}x DDP")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=50.0, help="each worker's link")
    parser.add_argument("--oversubscription", type=float, default=4.0)
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="one-way spine delay (needs netem)")
    parser.add_argument("--size-mb", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--layouts", default="4x2,4x4",
                        help="comma-separated PERxRACKS worker layouts")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_network needs root (network namespaces, tc)", file=sys.stderr)
        return 1
    delay = args.delay_ms
    if delay and not netem_available():
        print(f"this kernel has no netem: the {delay} ms spine delay is left out")
        delay = 0.0
    try:
        with tempfile.TemporaryDirectory(prefix="ringwright-bench-net-") as tmp:
            for i, layout in enumerate(args.layouts.split(",")):
                per, racks = (int(v) for v in layout.split("x"))
                spec = NetworkSpec(racks=(per,) * racks, worker_mbit=args.mbit,
                                   oversubscription=args.oversubscription,
                                   spine_delay_ms=delay)
                with EmulatedNetwork(spec) as net:
                    print(f"\n== {per * racks} workers, {racks} racks of {per}: worker links "
                          f"{args.mbit:g} Mbit/s, uplinks {spec.uplink_mbit(0):g} Mbit/s "
                          f"({args.oversubscription:g}:1), spine delay {delay:g} ms")
                    if i == 0:
                        inside = probe(net, net.hosts[0], net.hosts[1])
                        across = probe(net, net.hosts[0], net.hosts[per])
                        print("alpha-beta fit (t = alpha + beta*l, from 1 B .. 4 MB transfers)")
                        for name, fit in (("inside a rack", inside), ("across racks", across)):
                            print(f"  {name:<14} alpha {fit.alpha_s * 1e6:8.1f} us   "
                                  f"beta {fit.beta_s_per_byte * 1e9:7.2f} ns/B   "
                                  f"= {fit.mbit_per_s:6.1f} Mbit/s")
                    measure(net, racks, args, Path(tmp), train=i == 0)
    except RunFailed as err:
        print(f"a measured run failed:\n{err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
