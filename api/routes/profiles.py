"""Cluster profiles and the clusters they belong to: ``/v1/profiles``, ``/v1/clusters``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from api import store
from api.bodies import FiniteJSONRoute
from api.deps import AUTH_RESPONSES, DB, NO_NUL, Id, Limit, Offset, Writer, aware, link, stored_utc
from api.schemas import ClusterSummary, Page, ProfileOut, ProfileSummary, ProfileUploaded
from planner.contracts import ClusterProfile, RunReport
from planner.errors import AutoparError

router = APIRouter(route_class=FiniteJSONRoute, tags=["profiles"])
Kind = Annotated[str | None, Query(pattern="^(measured|reference)$")]


def profile_summary(entry: store.ProfileEntry) -> ProfileSummary:
    p, c = entry.profile, entry.cluster
    return ProfileSummary(id=p.id, cluster=c.name, version=p.version, kind=p.kind, gpu_name=p.gpu_name,
                          gpus_per_node=p.gpus_per_node, num_nodes=p.num_nodes, measured_at=aware(p.measured_at),
                          uploaded_at=aware(p.uploaded_at), content_hash=p.content_hash)


@router.post("/v1/profiles", status_code=201, dependencies=[Writer],
             responses={200: {"description": "the same content was stored before: that profile",
                              "model": ProfileUploaded},
                        201: {"links": link("GetProfile", "profile_id")}, **AUTH_RESPONSES})
def upload_profile(profile: ClusterProfile, db: DB, response: Response) -> ProfileUploaded:
    """Store a ClusterProfile (measured or reference) as the next version of its cluster (``name``).

    Profiles are immutable; the same content uploaded again returns the stored one (200, ``created: false``)."""
    for field, value in (("name", profile.name), ("device.name", profile.device.name)):
        if "\x00" in value:
            raise AutoparError(field, value, "remove the NUL character", problem="contains a NUL character")
    profile.created_at = aware(profile.created_at)
    uploaded = store.upload_profile(db, profile=profile)
    if not uploaded.created:
        response.status_code = 200
    return ProfileUploaded(**profile_summary(uploaded.entry).model_dump(),
                           profile=ClusterProfile.model_validate(uploaded.entry.profile.body),
                           created=uploaded.created)


@router.get("/v1/profiles")
def list_profiles(db: DB, limit: Limit = 50, offset: Offset = 0,
                  gpu: Annotated[str | None, Query(max_length=200, pattern=NO_NUL,
                                                   description="device name contains (any case)")] = None,
                  kind: Kind = None,
                  cluster: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
                  since: Annotated[datetime | None, Query(description="measured at or after (ISO 8601)")] = None,
                  until: Annotated[datetime | None, Query(description="measured at or before (ISO 8601)")] = None,
                  ) -> Page[ProfileSummary]:
    """Stored profiles, newest upload first."""
    if since is not None and until is not None and stored_utc(since, db) > stored_utc(until, db):
        raise AutoparError("since", since.isoformat(), f"give a since at or before until={until.isoformat()} (or "
                           "swap them)", problem="is after until: the range is empty")
    page = store.list_profiles(db, gpu=gpu, kind=kind, cluster=cluster, since=stored_utc(since, db),
                               until=stored_utc(until, db), limit=limit, offset=offset)
    return Page[ProfileSummary](items=[profile_summary(e) for e in page.items], total=page.total, limit=limit,
                                offset=offset)


@router.get("/v1/profiles/{profile_id}", responses={404: {"description": "no such profile"}})
def get_profile(profile_id: Id, db: DB) -> ProfileOut:
    entry = store.get_profile(db, profile_id=profile_id)
    return ProfileOut(**profile_summary(entry).model_dump(), profile=ClusterProfile.model_validate(entry.profile.body))


@router.get("/v1/clusters")
def list_clusters(db: DB, limit: Limit = 50, offset: Offset = 0,
                  gpu: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
                  kind: Kind = None) -> Page[ClusterSummary]:
    """Clusters with their newest profile."""
    page = store.list_clusters(db, gpu=gpu, kind=kind, limit=limit, offset=offset)
    items = [ClusterSummary(name=e.cluster.name, latest_profile_id=e.latest.id, versions=e.versions, kind=e.latest.kind,
                            gpu_name=e.latest.gpu_name, gpus_per_node=e.latest.gpus_per_node,
                            num_nodes=e.latest.num_nodes) for e in page.items]
    return Page[ClusterSummary](items=items, total=page.total, limit=limit, offset=offset)


@router.post("/v1/clusters/{name}/calibrate", status_code=201, dependencies=[Writer],
             responses={404: {"description": "no such cluster"}, 200: {"description": "the same calibration was "
                        "stored before: that profile", "model": ProfileUploaded}, **AUTH_RESPONSES})
def calibrate_cluster(name: Annotated[str, Path(max_length=200, pattern=NO_NUL)], db: DB,
                      response: Response) -> ProfileUploaded:
    """Fit the cluster's newest profile to the stored runs of its plans (those whose report has a breakdown by
    term: ``autopar run --profile-steps`` >= 1) and store the calibrated profile as its next version; its
    ``calibration`` says by how much each term moved and how far to trust it (planner/run_calibration.py)."""
    from planner.contracts import Plan
    from planner.run_calibration import CalibrationRun, calibrate, usable

    latest = ClusterProfile.model_validate(store.latest_profile(db, cluster=name).profile.body)
    stored = [CalibrationRun(f"run {e.run.id}", Plan.model_validate(e.plan.plan),
                             RunReport.model_validate(e.run.report)) for e in store.cluster_runs(db, cluster=name)]
    runs, left_out = usable(stored, latest)  # a run without a breakdown, or of another GPU count, is left out
    if len(runs) < 2:
        raise AutoparError("runs", len(runs), "post at least two runs of this cluster's plans measured with "
                           "`autopar run --profile-steps 2` (the default) and --server",
                           problem=f"of cluster '{name}' that can be fitted are too few to calibrate on"
                           + (f" (left out: {'; '.join(left_out)})" if left_out else ""))
    done = calibrate(latest, runs, left_out)
    done.created_at = aware(datetime.now(UTC))
    uploaded = store.upload_profile(db, profile=done)
    if not uploaded.created:
        response.status_code = 200
    return ProfileUploaded(**profile_summary(uploaded.entry).model_dump(),
                           profile=ClusterProfile.model_validate(uploaded.entry.profile.body), created=uploaded.created)


@router.get("/v1/clusters/{name}/profiles", responses={404: {"description": "no such cluster"}})
def cluster_history(name: Annotated[str, Path(max_length=200, pattern=NO_NUL)], db: DB, limit: Limit = 50,
                    offset: Offset = 0) -> Page[ProfileSummary]:
    """The versions of a cluster's profile, oldest first, a page as every list answers."""
    history = store.cluster_history(db, name=name)
    return Page[ProfileSummary](items=[profile_summary(e) for e in history[offset:offset + limit]],
                                total=len(history), limit=limit, offset=offset)
