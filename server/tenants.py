"""API keys as tenants: names, per-key prefix-cache salts and quota parsing.

Each configured API key is a tenant named `tenant0`, `tenant1`, ... in the order the
keys were given. The name is what metrics labels, quotas and logs use; the key itself
never leaves the auth check. A tenant's prefix-cache salt is derived from its key, so two
tenants never share (or probe by timing) each other's cached prefixes, whatever
`cache_salt` their requests send.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str = field(repr=False)  # the secret; never logged, never a label
    salt: str = field(init=False, repr=False)  # sha256(key), hex

    def __post_init__(self) -> None:
        object.__setattr__(self, "salt", hashlib.sha256(self.key.encode()).hexdigest())


def make_tenants(keys: Sequence[str]) -> list[Tenant]:
    """One tenant per key, in order; empty or repeated keys are a ValueError."""
    seen: set[str] = set()
    for i, key in enumerate(keys):
        if not key or key != key.strip():
            raise ValueError(f"API key #{i + 1} is empty or has surrounding whitespace")
        if key in seen:
            raise ValueError(f"API key #{i + 1} repeats an earlier key; every key is its own "
                             "tenant, so keys must be distinct")
        seen.add(key)
    return [Tenant(f"tenant{i}", k) for i, k in enumerate(keys)]


def parse_api_keys(cli: Iterable[str] | None, env: str | None) -> list[str]:
    """`--api-key` values (repeatable) win; otherwise `KVSERVE_API_KEY`, comma-separated."""
    if cli:
        return list(cli)
    if not env:
        return []
    return [k.strip() for k in env.split(",") if k.strip()]


def effective_salt(tenant: Tenant | None, cache_salt: str | None) -> str | None:
    """The salt the engine hashes into prefix-cache keys: the tenant's key-derived salt
    plus the request's `cache_salt`. Without API keys it is the `cache_salt` alone."""
    if tenant is None:
        return cache_salt
    return f"{tenant.salt}:{cache_salt or ''}"


def _mask(key: str) -> str:
    return f"{key[:2]}…" if len(key) > 4 else "…"


def parse_tenant_quotas(specs: Iterable[str] | None, tenants: Sequence[Tenant]
                        ) -> dict[str, float]:
    """`KEY=FRACTION` entries -> {tenant name: fraction}.

    KEY is one of the API keys, or the tenant's name (`tenant0`, ...) so that secrets
    need not appear on a command line; keys are matched first. Raises ValueError with a
    message naming the entry: unknown key, fraction not in (0, 1], a tenant given twice,
    fractions summing to more than 1, or to exactly 1 while a tenant has no quota (with
    no burst pool left it could never run).
    """
    specs = list(specs or [])
    if specs and not tenants:
        raise ValueError("--tenant-quota needs API keys (--api-key or KVSERVE_API_KEY): "
                         "each key is a tenant")
    by_key = {t.key: t for t in tenants}
    by_name = {t.name: t for t in tenants}
    quotas: dict[str, float] = {}
    for i, spec in enumerate(specs, 1):
        key, sep, value = spec.rpartition("=")
        if not sep or not key:
            raise ValueError(f"--tenant-quota #{i}: expected KEY=FRACTION, e.g. "
                             f"--tenant-quota tenant0=0.5")
        tenant = by_key.get(key) or by_name.get(key)
        if tenant is None:
            raise ValueError(f"--tenant-quota #{i}: {_mask(key)!r} is neither one of the "
                             f"{len(tenants)} API keys nor a tenant name "
                             f"({', '.join(by_name)})")
        try:
            fraction = float(value)
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:  # also rejects nan
            raise ValueError(f"--tenant-quota #{i} ({tenant.name}): the fraction must be a "
                             f"number in (0, 1], got {value!r}")
        if tenant.name in quotas:
            raise ValueError(f"--tenant-quota #{i}: {tenant.name} already has a quota")
        quotas[tenant.name] = fraction
    total = sum(quotas.values())
    if total > 1 + 1e-9:
        raise ValueError(f"--tenant-quota: the fractions sum to {total:g} > 1 (each tenant's "
                         "share is reserved; the shared burst pool is 1 - the sum)")
    without = [t.name for t in tenants if t.name not in quotas]
    if quotas and without and total >= 1 - 1e-9:
        raise ValueError(f"--tenant-quota: the fractions sum to 1, which leaves no burst "
                         f"pool for {', '.join(without)} (no quota of its own): its requests "
                         "could never run; give it a quota or lower the others")
    while sum(quotas.values()) > 1:  # 0.1 + 0.2 + 0.7 rounding: the engine wants <= 1
        quotas = {k: v * (1 - 1e-12) for k, v in quotas.items()}
    return quotas
