"""What a job's pod templates may ask for, as the admin's SchedulingPolicy allows.

Whoever may create a TrainingJob must not get, through the operator's hands, what they
could not get by creating a pod themselves: host namespaces, privilege, added
capabilities, host paths, a pinned node, another ServiceAccount, root. The defaults
refuse all of it. The check is pure (:func:`violations`); the reconcile round turns a
refusal into a condition and an event that name the field, and creates no pod.

Containers that set no securityContext get :func:`default_security_context`: non-root,
no privilege escalation, every capability dropped, the runtime's default seccomp
profile. One that sets a securityContext keeps it, once the check has passed it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from ringwright.objects import Obj

from .base import ApiModel, cel, validations

TEMPLATE_CONDITION = "TemplateAllowed"
"""The job condition that says whether its templates are within the policy."""

Capability = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Z][A-Z_]*$")]
HostPathPrefix = Annotated[str, Field(min_length=1, max_length=4096)]
AccountName = Annotated[str, Field(min_length=1, max_length=253)]


class TemplateLimits(ApiModel):
    """What the pod templates of jobs placed by this policy may ask for. Everything
    defaults to refused."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("self.allowedHostPaths.all(p, p.startsWith('/'))",
                "spec.templates.allowedHostPaths must be absolute paths"),
            cel("!self.allowedCapabilities.exists(c, c == 'ALL') || self.allowPrivileged",
                "spec.templates.allowedCapabilities may hold ALL only when "
                "spec.templates.allowPrivileged is true"),
        )
    )

    allow_host_network: bool = Field(default=False, description="Templates may set hostNetwork.")
    allow_host_pid: bool = Field(default=False, alias="allowHostPID",
                                 description="Templates may set hostPID.")
    allow_host_ipc: bool = Field(default=False, alias="allowHostIPC",
                                 description="Templates may set hostIPC.")
    allow_privileged: bool = Field(
        default=False, description="Containers may be privileged or allow privilege escalation.")
    allow_run_as_root: bool = Field(
        default=False, description="Containers may run as uid 0 (runAsUser: 0 or "
        "runAsNonRoot: false).")
    allowed_capabilities: list[Capability] = Field(
        default_factory=list, max_length=64,
        description="Capabilities containers may add (securityContext.capabilities.add), "
        "without the CAP_ prefix.", json_schema_extra={"x-kubernetes-list-type": "set"})
    allowed_host_paths: list[HostPathPrefix] = Field(
        default_factory=list, max_length=64,
        description="hostPath volumes may mount these paths or paths below them.",
        json_schema_extra={"x-kubernetes-list-type": "set"})
    allow_node_name: bool = Field(
        default=False, description="Templates may pin pods to a node (nodeName), bypassing "
        "placement.")
    allowed_service_accounts: list[AccountName] = Field(
        default_factory=list, max_length=64,
        description="ServiceAccounts templates may name (serviceAccountName); the pods "
        "then run as it instead of the job's own, which must grant what the runtime needs.",
        json_schema_extra={"x-kubernetes-list-type": "set"})


def default_security_context() -> Obj:
    """The securityContext a container gets when its template sets none."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _containers(spec: Obj) -> Iterator[tuple[str, Obj]]:
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or []):
            yield f"{kind}[{i}]", container


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix if prefix == "/" else prefix + "/")


def _security_violations(at: str, sc: Obj, limits: TemplateLimits,
                         pod_sc: Obj) -> Iterator[str]:
    if sc.get("privileged") and not limits.allow_privileged:
        yield f"{at}.securityContext.privileged is true (allowPrivileged)"
    if sc.get("allowPrivilegeEscalation") and not limits.allow_privileged:
        yield f"{at}.securityContext.allowPrivilegeEscalation is true (allowPrivileged)"
    added = (sc.get("capabilities") or {}).get("add") or []
    extra = [c for c in added if str(c).removeprefix("CAP_") not in limits.allowed_capabilities]
    if extra:
        yield (f"{at}.securityContext.capabilities.add names {', '.join(map(str, extra))} "
               "(allowedCapabilities)")
    if not limits.allow_run_as_root:
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if uid == 0:
            yield f"{at}.securityContext.runAsUser is 0 (allowRunAsRoot)"
        elif non_root is False:
            yield f"{at}.securityContext.runAsNonRoot is false (allowRunAsRoot)"


def violations(template_spec: Obj, limits: TemplateLimits, where: str) -> list[str]:
    """Fields of a pod template's ``spec`` (at ``where``, e.g.
    ``spec.workers.template.spec``) that ``limits`` do not allow, each with the policy
    field that would allow it."""
    found: list[str] = []
    flags = (("hostNetwork", limits.allow_host_network, "allowHostNetwork"),
             ("hostPID", limits.allow_host_pid, "allowHostPID"),
             ("hostIPC", limits.allow_host_ipc, "allowHostIPC"))
    for field, allowed, knob in flags:
        if template_spec.get(field) and not allowed:
            found.append(f"{where}.{field} is true ({knob})")
    if template_spec.get("nodeName") and not limits.allow_node_name:
        found.append(f"{where}.nodeName is set (allowNodeName)")
    account = template_spec.get("serviceAccountName") or template_spec.get("serviceAccount")
    if account and account not in limits.allowed_service_accounts:
        found.append(f"{where}.serviceAccountName is {account!r} (allowedServiceAccounts)")
    for i, volume in enumerate(template_spec.get("volumes") or []):
        host = volume.get("hostPath")
        if host is not None and not any(_under(str(host.get("path", "")), p)
                                        for p in limits.allowed_host_paths):
            found.append(f"{where}.volumes[{i}].hostPath.path is {host.get('path')!r} "
                         "(allowedHostPaths)")
    pod_sc: Obj = template_spec.get("securityContext") or {}
    if pod_sc.get("runAsUser") == 0 and not limits.allow_run_as_root:
        found.append(f"{where}.securityContext.runAsUser is 0 (allowRunAsRoot)")
    for at, container in _containers(template_spec):
        found.extend(_security_violations(f"{where}.{at}", container.get("securityContext")
                                          or {}, limits, pod_sc))
    return found


def job_violations(job_spec: Obj, limits: TemplateLimits) -> list[str]:
    """:func:`violations` of every role's template of a TrainingJob ``spec``."""
    found: list[str] = []
    for role in ("workers", "ps"):
        template: Any = (job_spec.get(role) or {}).get("template")
        if template:
            found.extend(violations(template.get("spec") or {}, limits,
                                    f"spec.{role}.template.spec"))
    return found


def secure(spec: Obj) -> None:
    """Give every container of pod ``spec`` that sets no securityContext the default one.

    Run only on templates that passed :func:`violations`: one that is set is allowed.
    """
    for _, container in _containers(spec):
        if not container.get("securityContext"):
            container["securityContext"] = default_security_context()
