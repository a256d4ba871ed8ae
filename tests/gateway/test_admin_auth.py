"""Admin routes accept only a valid admin JWT; every refusal is a 401 and is audited."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from pathlib import Path

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from loramux.gateway.auth.admin_jwt import AUDIENCE, CLOCK_SKEW_SECONDS, DEFAULT_MAX_TTL
from loramux.gateway.cli import main
from loramux.gateway.errors import Unauthorized
from loramux.gateway.server import RunningServer
from loramux.gateway.setting_checks import ConfigError
from loramux.gateway.settings import ServerSettings, Settings
from loramux.gateway.state import admin_auth, admin_secret
from tests.gateway.conftest import admin_client, json_of

MAX_TTL = DEFAULT_MAX_TTL  # the test gateway leaves LORAMUX_ADMIN_TOKEN_MAX_TTL unset
ADMIN_ROUTES = [
    ("GET", "/admin/tenants"),
    ("POST", "/admin/tenants"),
    ("GET", "/admin/tenants/tnt_x"),
    ("PATCH", "/admin/tenants/tnt_x"),
    ("DELETE", "/admin/tenants/tnt_x"),
    ("POST", "/admin/tenants/tnt_x/keys"),
    ("GET", "/admin/tenants/tnt_x/keys"),
    ("DELETE", "/admin/keys/k"),
    ("PUT", "/admin/tenants/tnt_x/quotas"),
    ("GET", "/admin/tenants/tnt_x/quotas"),
    ("PUT", "/admin/keys/k/quotas"),
    ("GET", "/admin/keys/k/quotas"),
    ("POST", "/admin/adapters"),
    ("GET", "/admin/adapters"),
    ("GET", "/admin/adapters/shared/a"),
    ("DELETE", "/admin/adapters/shared/a"),
    ("GET", "/admin/usage"),
    ("GET", "/admin/audit"),
]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**changes: object) -> dict[str, object]:
    now = int(time.time())
    base: dict[str, object] = {
        "sub": "mallory",
        "iat": now,
        "exp": now + 600,
        "aud": AUDIENCE,
        "role": "admin",
    }
    return {k: v for k, v in (base | changes).items() if v is not None}


def signed(secret: str, **changes: object) -> str:
    return jwt.encode(claims(**changes), secret, algorithm="HS256")


def unsigned(**changes: object) -> str:
    """An `alg: none` token: header and payload, empty signature."""
    header = b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{b64(json.dumps(claims(**changes)).encode())}."


def refusal(gateway: RunningServer, method: str, path: str, auth: str | None) -> dict:
    headers = {"authorization": auth} if auth is not None else {}
    response = httpx.request(method, gateway.url + path, headers=headers, timeout=30)
    assert response.status_code == 401, (method, path, response.text)
    return json_of(response)["error"]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_every_admin_route_needs_a_token(gateway: RunningServer, method: str, path: str) -> None:
    assert refusal(gateway, method, path, None)["code"] == "invalid_token"


def bad_tokens(gateway: RunningServer, tenant_key: str) -> dict[str, str]:
    secret = admin_secret(gateway.state.settings)
    now = int(time.time())
    return {
        "tenant API key": tenant_key,
        "expired": gateway.state.admin.mint("test-admin", ttl_seconds=-60),
        "other secret": signed("not-the-secret-" + "x" * 40),
        "wrong audience": signed(secret, aud="someone-else"),
        "alg none": unsigned(),
        "no exp": signed(secret, exp=None),
        "not admin role": signed(secret, role="tenant"),
        "issued later": signed(secret, iat=None, exp=now + 60),
        "garbage": "not.a.jwt",
        "exp 1e20": signed(secret, exp=1e20),
        "exp past 64 bits": signed(secret, exp=10**30),
        "exp infinite": signed(secret, exp=float("inf")),
        "exp not a number": signed(secret, exp=float("nan")),
        "exp as a float": signed(secret, exp=now + 600.5),
        "exp as a string": signed(secret, exp=str(now + 600)),
        "iat as a float": signed(secret, iat=float(now)),
        "lives a second too long": signed(secret, exp=now + MAX_TTL + 1),
        "issued long ago": signed(secret, iat=now - 2 * MAX_TTL, exp=now + 60),
        "nested claims": signed_text(secret, '{"sub": ' + "[" * 5000 + "]" * 5000 + "}"),
    }


def signed_text(secret: str, payload: str) -> str:
    """An HS256 token over a payload written by hand (PyJWT cannot encode every hostile one)."""
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(payload.encode())
    mac = hmac.new(secret.encode(), head.encode(), hashlib.sha256).digest()
    return f"{head}.{b64(mac)}"


def test_bad_tokens_are_refused_and_audited(gateway: RunningServer, admin: httpx.Client) -> None:
    tenant = json_of(admin.post("/admin/tenants", json={"name": f"auth-{uuid.uuid4().hex[:8]}"}))
    tenant_key = json_of(admin.post(f"/admin/tenants/{tenant['id']}/keys"))["key"]
    for label, token in bad_tokens(gateway, tenant_key).items():
        error = refusal(gateway, "GET", "/admin/tenants", f"Bearer {token}")
        assert error["code"] == "invalid_token", label
    # The same secret, audience and claims with HS256 pass: the refusals above were the point.
    secret = admin_secret(gateway.state.settings)
    assert admin.get("/admin/tenants", headers={"authorization": f"Bearer {signed(secret)}"})

    entries = json_of(admin.get("/admin/audit", params={"limit": 200}))["items"]
    denied = [e for e in entries if e["action"] == "admin.auth"]
    assert len(denied) >= len(bad_tokens(gateway, tenant_key))
    assert {e["actor"] for e in denied} == {"anonymous"}
    assert all(e["outcome"] == "invalid_token" for e in denied)
    assert "GET /admin/tenants" in {e["target"] for e in denied}


def test_a_valid_token_names_the_actor_in_the_audit_log(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    token = gateway.state.admin.mint("alice@ops", ttl_seconds=60)
    name = f"actor-{uuid.uuid4().hex[:8]}"
    created = httpx.post(
        gateway.url + "/admin/tenants",
        json={"name": name},
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    entries = json_of(admin.get("/admin/audit", params={"name": created.json()["id"]}))["items"]
    entry = next(e for e in entries if e["target"] == created.json()["id"])
    assert (entry["actor"], entry["action"], entry["outcome"]) == (
        "alice@ops",
        "tenant.create",
        "ok",
    )
    assert entry["detail"] == {"name": name}


def test_a_token_living_exactly_the_maximum_is_accepted(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    now = int(time.time())
    token = signed(admin_secret(gateway.state.settings), iat=now, exp=now + MAX_TTL)
    assert admin.get("/admin/tenants", headers={"authorization": f"Bearer {token}"})


def test_a_token_minted_on_a_clock_a_little_ahead_is_accepted(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """RS256 tokens are minted on other hosts: one whose clock runs a few seconds ahead mints
    `iat` in our future and `exp = iat + max`. Up to CLOCK_SKEW_SECONDS of that is accepted,
    not more."""
    secret = admin_secret(gateway.state.settings)
    for ahead, status in ((2, 200), (CLOCK_SKEW_SECONDS - 5, 200), (CLOCK_SKEW_SECONDS + 60, 401)):
        iat = int(time.time()) + ahead
        token = signed(secret, iat=iat, exp=iat + MAX_TTL)
        got = admin.get("/admin/tenants", headers={"authorization": f"Bearer {token}"})
        assert got.status_code == status, (ahead, got.text)


def test_the_cli_mints_tokens_within_the_maximum_lifetime(
    gateway: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(gateway.state.settings.data_dir))
    main(["admin-token", "--subject", "cli-user", "--ttl", "120"])
    token = capsys.readouterr().out.strip()
    response = httpx.get(
        gateway.url + "/admin/tenants", headers={"authorization": f"Bearer {token}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    payload = jwt.decode(token, options={"verify_signature": False})
    assert payload["exp"] - payload["iat"] == 120

    for ttl in (str(MAX_TTL + 1), "0"):
        with pytest.raises(SystemExit) as exited:
            main(["admin-token", "--ttl", ttl])
        assert "LORAMUX_ADMIN_TOKEN_MAX_TTL" in str(exited.value.code)
    assert capsys.readouterr().out == ""


def test_a_refused_token_is_audited_whatever_its_path_holds(each_gateway: RunningServer) -> None:
    """The guard audits a refused token with its path as the target, and a path holding NUL
    is audited with it written `\\x00`, on both databases. PostgreSQL cannot store NUL: the
    entry's write failed and was only logged, so guessing tokens on such paths left no trace."""
    marker = f"probe-{uuid.uuid4().hex[:8]}"
    for path in (f"/admin/tenants/{marker}", f"/admin/tenants/{marker}%00"):
        assert refusal(each_gateway, "GET", path, "Bearer forged")["code"] == "invalid_token"
    with admin_client(each_gateway) as admin:
        entries = json_of(admin.get("/admin/audit", params={"name": marker}))["items"]
    assert sorted((e["actor"], e["action"], e["target"]) for e in entries) == [
        ("anonymous", "admin.auth", f"GET /admin/tenants/{marker}"),
        ("anonymous", "admin.auth", f"GET /admin/tenants/{marker}\\x00"),
    ]


def test_an_admin_secret_under_32_bytes_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The admin secret also signs (derived) every dashboard session cookie a tenant holds: a
    short one would be found from a cookie offline, and admin tokens minted with it. The refusal
    names the variable, or the data dir's file, never the secret."""
    monkeypatch.setenv("LORAMUX_ADMIN_SECRET", "hunter2")
    with pytest.raises(ConfigError, match="LORAMUX_ADMIN_SECRET must be at least 32 bytes") as e:
        ServerSettings()
    assert "hunter2" not in str(e.value)
    monkeypatch.setenv("LORAMUX_ADMIN_SECRET", "é" * 16)  # 32 bytes
    assert ServerSettings().admin_secret == "é" * 16

    monkeypatch.delenv("LORAMUX_ADMIN_SECRET")
    settings = Settings(data_dir=tmp_path)
    assert len(admin_secret(settings)) >= 32  # the generated one
    (tmp_path / "admin_secret").write_text("changeme\n")
    with pytest.raises(ConfigError, match="admin_secret must be at least 32 bytes"):
        admin_secret(settings)


@pytest.fixture(scope="module")
def rsa_key() -> tuple[rsa.RSAPrivateKey, str]:
    """An RSA key and its public PEM, one whose base64 runs over 255 characters between two
    `/` (about one key in twenty): taken for a path, a component of it is too long a name."""
    while True:
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = (
            private.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )
        if max(len(part) for part in pem.split("/")) > 255:
            return private, pem


def rs256(private: rsa.RSAPrivateKey, **changes: object) -> str:
    return jwt.encode(claims(**changes), private, algorithm="RS256")


def test_an_rs256_public_key_is_taken_as_its_pem_text_or_a_file_holding_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rsa_key: tuple[rsa.RSAPrivateKey, str]
) -> None:
    """PEM text is never tried as a path: this key's made that try fail (ENAMETOOLONG), so the
    gateway could not start with it."""
    private, pem = rsa_key
    (tmp_path / "admin.pem").write_text(pem)
    for value in (pem, str(tmp_path / "admin.pem")):
        monkeypatch.setenv("LORAMUX_ADMIN_PUBLIC_KEY", value)
        auth = admin_auth(Settings(data_dir=tmp_path))
        assert auth.verify(f"Bearer {rs256(private, sub='idp')}").subject == "idp"


def test_an_admin_public_key_that_gives_no_rsa_key_is_refused_when_settings_are_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Taken as it was, a mistyped path or text that is no key let the gateway start and then
    refuse every admin token. Refused by the variable's name now, before anything starts."""
    (tmp_path / "garbage.pem").write_text("not a key\n")
    ec_key = ec.generate_private_key(ec.SECP256R1()).public_key()
    ec_pem = ec_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    for value, why in (
        (str(tmp_path / "no-such-admin.pem"), "no file that can be read"),
        ("not a key", "no file that can be read"),
        (str(tmp_path), "no file that can be read"),
        (str(tmp_path / "garbage.pem"), "the file .* holds none"),
        ("-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n", "value holds"),
        (ec_pem, "the value holds none"),
    ):
        monkeypatch.setenv("LORAMUX_ADMIN_PUBLIC_KEY", value)
        with pytest.raises(ConfigError, match=f"LORAMUX_ADMIN_PUBLIC_KEY must be .*{why}"):
            ServerSettings()


def test_the_cli_says_in_one_line_that_it_cannot_mint_rs256_tokens(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rsa_key: tuple[rsa.RSAPrivateKey, str],
) -> None:
    """RS256 admin tokens are minted where the private key is; `admin-token` said so with a
    traceback (a ValueError from the minting)."""
    monkeypatch.setenv("LORAMUX_ADMIN_PUBLIC_KEY", rsa_key[1])
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main(["admin-token"])
    assert isinstance(exited.value.code, str)
    assert exited.value.code.startswith("loramux admin-token: admin tokens are RS256")
    assert "\n" not in exited.value.code
    assert capsys.readouterr().out == ""


def test_an_rs256_token_is_taken_with_the_claims_the_readme_lists(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rsa_key: tuple[rsa.RSAPrivateKey, str]
) -> None:
    """What an externally minted token must carry (README, "Operators manage ..."): the table
    there and these cases say the same."""
    private, pem = rsa_key
    monkeypatch.setenv("LORAMUX_ADMIN_PUBLIC_KEY", pem)
    auth = admin_auth(Settings(data_dir=tmp_path))
    now = int(time.time())
    taken = [{}, {"aud": ["other", AUDIENCE]}, {"nbf": now}, {"jti": "x", "scope": "any"}]
    for changes in taken:
        assert auth.verify(f"Bearer {rs256(private, **changes)}").subject == "mallory"
    refused: list[dict[str, object]] = [
        {"aud": "other"},
        {"role": None},
        {"role": "user"},
        {"sub": 7},
        {"iat": float(now)},
        {"exp": str(now + 60)},
        {"exp": now + MAX_TTL + CLOCK_SKEW_SECONDS + 60},
        {"nbf": now + 600},
        {"jti": 7},
    ]
    for changes in refused:
        with pytest.raises(Unauthorized):
            auth.verify(f"Bearer {rs256(private, **changes)}")
    with pytest.raises(Unauthorized):  # the algorithm is pinned: not HS256 keyed by the PEM
        auth.verify(f"Bearer {jwt.encode(claims(), 'k' * 32, algorithm='HS256')}")
