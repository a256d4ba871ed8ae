"""The RSA public key that verifies RS256 admin tokens (LORAMUX_ADMIN_PUBLIC_KEY), read and
checked when the settings are read. A module of its own, imported only when the setting is set:
the settings are read on the GPU image too, which has no `cryptography`."""

from __future__ import annotations

from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from loramux.gateway.setting_checks import ConfigError


def admin_public_key_pem(value: str) -> str:
    """The RSA public key LORAMUX_ADMIN_PUBLIC_KEY gives, in PEM: the value itself when it is
    PEM (it starts with `-----BEGIN`), else the file it names. PEM text is never tried as a
    path: a key whose base64 runs over 255 characters between two `/` (about one in twenty)
    made that try fail with ENAMETOOLONG, and the gateway could not start. A value that gives
    no RSA public key is a ConfigError: taken as it was, every admin token was refused."""
    wanted = "an RSA public key in PEM (its text, from -----BEGIN, or a file holding it)"
    if value.lstrip().startswith("-----BEGIN"):
        pem, source = value.encode(), "the value"
    else:
        try:
            pem, source = Path(value).read_bytes(), f"the file {value!r}"
        except OSError as exc:
            raise ConfigError(
                f"LORAMUX_ADMIN_PUBLIC_KEY must be {wanted}: {value!r} is no file that can be "
                f"read ({exc.strerror})"
            ) from None
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, UnsupportedAlgorithm):
        key = None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ConfigError(f"LORAMUX_ADMIN_PUBLIC_KEY must be {wanted}: {source} holds none")
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
