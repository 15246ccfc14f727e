"""Checkpoints in object storage: spec.checkpoint's endpoint, region and Secret reach every
training pod as the standard AWS variables, the credentials by reference only."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.plan.manifests import PS, WORKER, pod


def job(**checkpoint: Any) -> Obj:
    template = {"spec": {"containers": [{"name": "train", "image": "img", "env": [
        {"name": "AWS_REGION", "value": "from-template"}, {"name": "MINE", "value": "1"}]}]}}
    return {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-tj", "generation": 1},
        "spec": {"mode": "ParameterServer",
                 "workers": {"replicas": 2, "template": template},
                 "ps": {"replicas": 1, "template": template},
                 "checkpoint": checkpoint},
    }


def env_of(body: Obj, role: str = WORKER) -> dict[str, Obj]:
    built = pod(body, role, 0, {})
    return {e["name"]: e for e in built["spec"]["containers"][0]["env"]}


def test_the_secret_endpoint_and_region_become_the_pods_variables() -> None:
    body = job(path="s3://models/tj", credentialsSecret="s3-creds",
               endpoint="http://minio.storage:9000", region="eu-west-1")
    for role in (WORKER, PS):
        env = env_of(body, role)
        assert env["AWS_ENDPOINT_URL_S3"] == {"name": "AWS_ENDPOINT_URL_S3",
                                              "value": "http://minio.storage:9000"}
        # The spec wins over the template's variable of the same name.
        assert env["AWS_REGION"] == {"name": "AWS_REGION", "value": "eu-west-1"}
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {
                "name": "s3-creds", "key": key, "optional": optional}}}
        assert env["MINE"] == {"name": "MINE", "value": "1"}


def test_a_path_alone_adds_nothing_and_keeps_the_templates_variables() -> None:
    for body in (job(path="/ckpt"), job(path="s3://models/tj"), job()):
        env = env_of(body)
        assert not {"AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                    "AWS_SESSION_TOKEN"} & env.keys()
        assert env["AWS_REGION"] == {"name": "AWS_REGION", "value": "from-template"}
