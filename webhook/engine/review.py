"""The admission.k8s.io AdmissionReview, typed.

Only the envelope is validated strictly: ``object``/``oldObject`` are whole
Kubernetes objects (a pod is ~10 KB of JSON) and validating them field by field
would cost more than the decision itself. ``workloads`` walks them leniently
instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # Kubernetes adds fields over time; unknown ones are ignored, not an error.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class GroupVersionKind(_Wire):
    group: str = ""
    version: str = ""
    kind: str


class GroupVersionResource(_Wire):
    group: str = ""
    version: str = ""
    resource: str = ""


class AdmissionRequest(_Wire):
    uid: str = Field(min_length=1)
    kind: GroupVersionKind
    resource: GroupVersionResource | None = None
    subResource: str | None = None
    name: str | None = None
    namespace: str | None = None
    operation: str
    object: Any = None
    oldObject: Any = None
    dryRun: bool | None = None


class AdmissionReviewRequest(_Wire):
    apiVersion: Literal["admission.k8s.io/v1", "admission.k8s.io/v1beta1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest
