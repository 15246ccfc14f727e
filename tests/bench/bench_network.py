"""What topology buys, on an emulated datacenter network (needs root).

Builds racks of worker namespaces under an oversubscribed spine that adds a one-way
delay on every uplink (:mod:`ringwright.devcluster.netemu`; a user-space delay line
where the kernel has no netem) and, for every spine delay and worker layout, in one run:

1. fits alpha + beta*l to point-to-point transfers inside a rack and across racks
   (first layout of each delay), and reports the delay-line relays' CPU time;
2. times a gloo ring all-reduce with ranks in ringwright's world order (the operator's
   ``order_ring``), in random order, and in pod-index order (pods spread over the
   racks by index, as a default scheduler spreads them);
3. times the hierarchical all-reduce (rack groups) against the world-ordered flat ring,
   for several message sizes;
4. times training steps: bucketed overlap vs DistributedDataParallel vs the flat
   all-reduce after backward (first network only).

The defaults are the issue's goal: 4:1 oversubscription, 8 and 16 workers on 2 and 4
racks. The delays are scaled with the links: at 50 Mbit/s a ring step of a 1 MB
all-reduce moves 64-128 KB in 10-20 ms, and a 2-5 ms one-way delay per uplink (4-10 ms
between racks) keeps latency at the share of a step it has for a 25 MB bucket on a
loaded 100 Gbit/s spine with tens of microseconds between racks.

Every ratio is against a baseline measured in the same run; the bench exits non-zero
when any measured run fails.

    python tests/bench/bench_network.py [--mbit 50] [--oversubscription 4] [--delays-ms 2,5]
                                        [--size-mb 4] [--sizes-mb 0.25,1,4] [--delay-line]

The alpha-beta table holds the figures tests/network/test_netemu.py does not assert:
bandwidth inside a rack against across racks, and the latency the spine's delay adds
between racks (``--delay-line``: through the user-space relay even where netem exists).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.devcluster.netemu import (  # noqa: E402
    EmulatedNetwork,
    Host,
    NetworkSpec,
)
from ringwright.devcluster.netprobe import AlphaBeta, fit_alpha_beta  # noqa: E402
from ringwright.operator.plan.ring import RingSlot, cross_rack_edges, order_ring  # noqa: E402
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


def world_of(ring: Sequence[Host], mode: HierarchicalAllReduce, generation: int) -> World:
    members = tuple(Member(rank=i, pod=h.namespace, ip=h.ip, node=h.namespace,
                           rack=f"rack-{h.rack}") for i, h in enumerate(ring))
    return World(job=JobRef(namespace="bench", name="network"), generation=generation,
                 members=members,
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


def fit_table(net: EmulatedNetwork, per_rack: int) -> None:
    """Print the alpha-beta fit inside a rack and across racks."""
    inside = probe(net, net.hosts[0], net.hosts[1])
    across = probe(net, net.hosts[0], net.hosts[per_rack])
    print("alpha-beta fit (t = alpha + beta*l, from 1 B .. 4 MB transfers)")
    for name, fit in (("inside a rack", inside), ("across racks", across)):
        print(f"  {name:<14} alpha {fit.alpha_s * 1e3:8.3f} ms   "
              f"beta {fit.beta_s_per_byte * 1e9:7.2f} ns/B   = {fit.mbit_per_s:6.1f} Mbit/s")


def reduce_env(size_mb: float, iters: int) -> dict[str, str]:
    return {"SIZE_MB": str(size_mb), "ITERS": str(iters)}


def measure(net: EmulatedNetwork, racks: int, args: argparse.Namespace, workdir: Path,
            *, train: bool) -> None:
    rings = orders(net.hosts, racks, seed=args.seed)
    world_ring = rings["world order"]
    env = reduce_env(args.size_mb, args.iters)
    runs = [("allreduce", world_of(ring, HierarchicalAllReduce.DISABLED, i), env)
            for i, ring in enumerate(rings.values())]
    sizes = [float(v) for v in args.sizes_mb.split(",")]
    for size in sizes:
        for mode in (HierarchicalAllReduce.DISABLED, HierarchicalAllReduce.ENABLED):
            runs.append(("allreduce", world_of(world_ring, mode, len(runs)),
                         reduce_env(size, args.iters)))
    if train:
        runs.append(("train", world_of(world_ring, HierarchicalAllReduce.DISABLED, len(runs)),
                     {"ITERS": str(args.iters), "LAYERS": str(args.layers),
                      "WIDTH": str(args.width), "BATCH": "64"}))
    cpu, started = net.relay_cpu_seconds(), time.monotonic()
    results = execute(net, runs, workdir)
    cpu, wall = net.relay_cpu_seconds() - cpu, time.monotonic() - started

    times = {name: r["seconds"] for name, r in zip(rings, results, strict=False)}
    base = times["world order"]
    print(f"{len(net.hosts)} workers on {racks} racks, {args.size_mb:g} MB float32 all-reduce "
          f"(median of {args.iters})")
    print(f"  {'ring':<18} {'cross-rack edges':>16} {'seconds':>9} {'vs world order':>15}")
    for name, seconds in times.items():
        edges = cross_rack_edges([str(h.rack) for h in rings[name]])
        print(f"  {name:<18} {edges:>16} {seconds:>9.3f} {seconds / base:>14.2f}x")
    print(f"  world order: {times['random order'] / base:.2f}x faster than random order, "
          f"{times['pod-index order'] / base:.2f}x faster than pod-index order")
    print(f"hierarchical vs the world-ordered flat ring (median of {args.iters})")
    print(f"  {'MB':>6} {'flat s':>8} {'hierarchical s':>15} {'speed-up':>9}")
    for i, size in enumerate(sizes):
        flat, two_level = (results[len(rings) + 2 * i + k]["seconds"] for k in (0, 1))
        print(f"  {size:>6g} {flat:>8.3f} {two_level:>15.3f} {flat / two_level:>8.2f}x")
    if net.plan.relays:
        print(f"delay-line relays: {cpu:.1f} CPU-s in {wall:.0f} s of runs, "
              f"{100 * cpu / wall / len(net.plan.relays):.1f}% of a core each")
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
    parser.add_argument("--delays-ms", default="2,5",
                        help="comma-separated one-way delays of every uplink")
    parser.add_argument("--size-mb", type=float, default=4.0,
                        help="all-reduce size of the rank-order comparison")
    parser.add_argument("--sizes-mb", default="0.25,1,4",
                        help="comma-separated all-reduce sizes of the hierarchical comparison")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--layouts", default="4x2,4x4",
                        help="comma-separated PERxRACKS worker layouts")
    parser.add_argument("--delay-line", action="store_true",
                        help="delay with the user-space relay even where the kernel has netem")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_network needs root (network namespaces, tc)", file=sys.stderr)
        return 1
    layouts = [tuple(int(v) for v in layout.split("x")) for layout in args.layouts.split(",")]
    try:
        with tempfile.TemporaryDirectory(prefix="ringwright-bench-net-") as tmp:
            for d, delay in enumerate(float(v) for v in args.delays_ms.split(",")):
                for i, (per, racks) in enumerate(layouts):
                    spec = NetworkSpec(racks=(per,) * racks, worker_mbit=args.mbit,
                                       oversubscription=args.oversubscription,
                                       spine_delay_ms=delay)
                    with EmulatedNetwork(spec, False if args.delay_line else None) as net:
                        how = "delay line" if net.plan.relays else "netem"
                        print(f"\n== {per * racks} workers, {racks} racks of {per}: worker "
                              f"links {args.mbit:g} Mbit/s, uplinks {spec.uplink_mbit(0):g} "
                              f"Mbit/s ({args.oversubscription:g}:1), {delay:g} ms one way "
                              f"on every uplink ({how})", flush=True)
                        if i == 0:
                            fit_table(net, per)
                        measure(net, racks, args, Path(tmp), train=d == 0 and i == 0)
    except RunFailed as err:
        print(f"a measured run failed:\n{err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
