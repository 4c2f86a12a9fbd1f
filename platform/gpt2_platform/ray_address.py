"""What a Ray address names, told without importing Ray: the environment check runs where Ray is missing."""

from __future__ import annotations


def is_dashboard_url(address: str | None) -> bool:
    """Whether `address` is the dashboard's http(s):// URL: the form `ray job submit` and docs/operating.md
    use for RAY_ADDRESS, which `ray.init()` cannot join (a driver needs the GCS's host:port)."""
    return address is not None and address.split("://", 1)[0] in ("http", "https")
