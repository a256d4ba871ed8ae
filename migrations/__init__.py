"""Alembic environment and revisions for every SQL table of the gateway (`gateway/db`).

Run through `gateway.db.migrate` (`loramux migrate`, or `upgrade(url)` on start); no alembic.ini is
needed for that. To write a new revision after changing a model, from the repository root:
`alembic -c migrations/alembic.ini revision --autogenerate -m "what changed"` against a database
at head (LORAMUX_DATABASE_URL, or the default SQLite file), then read and tidy the result.
"""
