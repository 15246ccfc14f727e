"""Real nodes' names, addresses, configuration and image, without starting anything."""

from __future__ import annotations

import io
import json
import tarfile
from ipaddress import ip_address, ip_network
from pathlib import Path

import pytest

from ringwright.devcluster.node import configs, image
from ringwright.devcluster.node.host import Proc
from ringwright.devcluster.node.layout import (
    BACKBONE_PREFIX_LEN,
    KUBELET_SYSCTLS,
    LINK_PREFIX_LEN,
    NODES_PER_SLOT,
    SLOTS,
    NodeLayout,
    RealNodeSpec,
    layouts,
)
from ringwright.devcluster.node.registry import SetRecord
from ringwright.devcluster.realnode import APT_PACKAGES, COMMANDS
from ringwright.devcluster.versions import COMPONENTS


def _every_layout(root: Path) -> list[NodeLayout]:
    return [NodeLayout(RealNodeSpec(f"n{s}-{i}"), s, i, root / f"n{s}-{i}")
            for s in range(SLOTS) for i in range(NODES_PER_SLOT)]


def test_no_two_nodes_on_the_machine_share_a_name_or_an_address(tmp_path: Path) -> None:
    every = _every_layout(tmp_path)
    for attr in ("netns", "cgroup", "host_link", "node_ip", "peer_ip", "pod_cidr"):
        values = [getattr(n, attr) for n in every]
        assert len(set(values)) == len(values), attr
    # Distinct /24s never overlap, and no link address lies in any of them.
    pod_nets = {ip_network(n.pod_cidr) for n in every}
    assert {net.prefixlen for net in pod_nets} == {24}
    for n in every:
        assert len(n.host_link) <= 15  # Linux interface names
        link = ip_network(f"{n.node_ip}/30", strict=False)
        assert ip_address(n.peer_ip) in link and not ip_address(n.node_ip).is_loopback
        assert ip_network(f"{n.node_ip}/24", strict=False) not in pod_nets


def test_the_backbone_addresses_lie_apart_from_the_links_and_the_pods(tmp_path: Path) -> None:
    every = _every_layout(tmp_path)
    backbone = [ip_address(n.backbone_ip) for n in every]
    assert len(set(backbone)) == len(backbone)
    links = [ip_network(f"{n.node_ip}/{LINK_PREFIX_LEN}", strict=False) for n in every]
    pods = [ip_network(n.pod_cidr) for n in every]
    assert not any(a in net for a in backbone for net in links + pods)
    for n in every:
        # One backbone per set, its subnet holding exactly the set's nodes.
        net = ip_network(f"{n.backbone_ip}/{BACKBONE_PREFIX_LEN}", strict=False)
        assert {m.backbone_netns for m in every if ip_address(m.backbone_ip) in net} \
            == {n.backbone_netns}
        assert n.backbone_netns not in {m.netns for m in every}


def test_a_set_refuses_repeated_names_and_too_many_nodes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeat"):
        layouts([RealNodeSpec("a"), RealNodeSpec("a")], 0, tmp_path)
    with pytest.raises(ValueError, match="1 to"):
        layouts([RealNodeSpec(f"n{i}") for i in range(NODES_PER_SLOT + 1)], 0, tmp_path)
    with pytest.raises(ValueError, match="unix socket"):
        layouts([RealNodeSpec("a")], 0, tmp_path / ("x" * 100))


def test_the_labels_are_the_inventorys_topology_labels() -> None:
    assert RealNodeSpec("n", rack="rack-7").labels() == {
        "ringwright.dev/real-node": "true", "ringwright.dev/rack": "rack-7",
        "nvidia.com/gpu.clique": "rack-7-nvl-0",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_the_kubelet_serves_on_the_node_address_only_and_owns_its_cgroup(
        tmp_path: Path) -> None:
    node = layouts([RealNodeSpec("a", rack="r")], 3, tmp_path)[0]
    config = configs.kubelet_config(node)
    assert config["address"] == config["healthzBindAddress"] == node.node_ip
    assert config["cgroupRoot"] == node.cgroup
    assert config["containerRuntimeEndpoint"] == f"unix://{node.containerd_socket}"
    argv = configs.kubelet_argv(node, Path("/bin/kubelet"), tmp_path / "kubeconfig")
    assert f"--node-ip={node.node_ip}" in argv and f"--root-dir={node.kubelet_root}" in argv
    labels = next(a for a in argv if a.startswith("--node-labels="))
    assert "ringwright.dev/rack=r" in labels.split("=", 1)[1].split(",")


def test_containerd_and_cni_stay_in_the_nodes_folder_and_namespace(tmp_path: Path) -> None:
    node = layouts([RealNodeSpec("a")], 1, tmp_path)[0]
    text = configs.containerd_config(node, sandbox_image="localhost/p:1",
                                     cni_bin_dir=Path("/usr/lib/cni"), runc=Path("/x/runc"))
    for line in text.splitlines():
        if "/" in line and "=" in line and "plugins." not in line:
            value = line.split("=", 1)[1]
            assert str(tmp_path) in value or "/usr/lib/cni" in value or "/x/runc" in value \
                or "localhost/p:1" in value or "io.containerd" in value, line
    assert f'stream_server_address = "{node.peer_ip}"' in text
    cni = configs.cni_config(node)["plugins"][0]
    assert cni["ipam"]["ranges"] == [[{"subnet": node.pod_cidr}]]
    assert cni["ipam"]["dataDir"].startswith(str(tmp_path)) and cni["ipMasq"] is False


def test_fixed_host_paths_and_kernel_settings_are_bound_over_with_the_nodes_own(
        tmp_path: Path) -> None:
    node = layouts([RealNodeSpec("a")], 0, tmp_path)[0]
    binds = dict((dst, src) for src, dst in node.binds())
    assert {"/var/log", "/var/lib/cni", "/run/containerd"} <= set(binds)
    assert {f"/proc/sys/{k}" for k in KUBELET_SYSCTLS} <= set(binds)
    assert all(src.is_relative_to(node.dir) for src in binds.values())


def test_a_record_round_trips(tmp_path: Path) -> None:
    record = SetRecord(slot=2, cluster_dir=str(tmp_path), owner=(10, 20),
                       nodes=[n.to_record() for n in layouts([RealNodeSpec("a", gpus=2)], 2,
                                                             tmp_path)],
                       processes=[Proc("kubelet", "a", 11, 12)])
    again = SetRecord.from_json(record.to_json())
    assert again == record
    assert again.layouts() == layouts([RealNodeSpec("a", gpus=2)], 2, tmp_path)


def _members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()  # type: ignore[union-attr]
                if m.isfile()}


def test_the_image_archive_is_a_reproducible_oci_layout_naming_its_image() -> None:
    archive = image.oci_archive(b"\x7fELF program", "localhost/ringwright/pause:abc", "amd64")
    assert archive == image.oci_archive(b"\x7fELF program", "localhost/ringwright/pause:abc",
                                        "amd64")
    files = _members(archive)
    index = json.loads(files["index.json"])
    entry = index["manifests"][0]
    assert entry["annotations"][image.CONTAINERD_NAME] == "localhost/ringwright/pause:abc"
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    assert config["config"]["Entrypoint"] == ["/pause"]
    assert any(e.startswith("PATH=") for e in config["config"]["Env"])
    layer = files[f"blobs/sha256/{manifest['layers'][0]['digest'].split(':')[1]}"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        (member,) = tar.getmembers()
        assert member.name == "pause" and member.mode == 0o755
        assert tar.extractfile(member).read() == b"\x7fELF program"  # type: ignore[union-attr]


def test_the_kubelet_is_built_from_the_kube_module_but_not_needed_by_the_cluster() -> None:
    kubelet = next(c for c in COMPONENTS if c.name == "kubelet")
    assert kubelet.module_dir == "kube" and not kubelet.control_plane


def test_the_install_script_installs_what_the_requirements_check_names() -> None:
    script = (Path(__file__).resolve().parents[2] / "scripts" / "install_host_packages.sh"
              ).read_text().splitlines()
    packages = next(line for line in script if line.startswith("packages=("))
    assert tuple(packages.removeprefix("packages=(").removesuffix(")").split()) == APT_PACKAGES
    commands = next(line for line in script if line.startswith("for cmd in "))
    assert tuple(commands.removeprefix("for cmd in ").split(";")[0].split()) == COMMANDS
