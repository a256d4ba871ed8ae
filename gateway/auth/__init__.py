"""Authentication: tenant API keys and admin JWTs."""
