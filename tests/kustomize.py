"""The Kubernetes manifests as `kubectl apply -k` would apply them: each overlay under deploy/k8s/overlays, rendered by
`kubectl kustomize` (the kustomize built into kubectl). `make test` installs kubectl where it is missing."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


@functools.cache
def _rendered(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: `make test` installs it (apt-get install kubectl)")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize deploy/k8s/overlays/{overlay} failed:\n{done.stderr}"
    return done.stdout


def render(overlay: str) -> list[dict]:
    """Every object the overlay applies, in a fresh copy the caller may change."""
    return [doc for doc in yaml.safe_load_all(_rendered(overlay)) if doc is not None]
