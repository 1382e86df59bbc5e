"""profiles.content_hash leaves out fields at their defaults (api.store.profile_hash)

Before, the hash covered every field, so a contract that gained an optional field
(LinkProfile.ranks_per_node) hashed a re-uploaded older file differently from its stored copy and
stored it again as a new version. The stored rows are rehashed under the new rule; a row whose new
hash an earlier row already holds (the same content stored twice) keeps its old hash.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""
import json

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    from api.store import profile_hash
    from planner.contracts import ClusterProfile

    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT id, body, content_hash FROM profiles ORDER BY id")).fetchall()
    taken = {row.content_hash for row in rows}
    for row in rows:
        body = json.loads(row.body) if isinstance(row.body, str) else row.body
        digest = profile_hash(ClusterProfile.model_validate(body))
        if digest == row.content_hash or digest in taken:
            continue
        bind.execute(sa.text("UPDATE profiles SET content_hash = :h WHERE id = :i"), {"h": digest, "i": row.id})
        taken.discard(row.content_hash)
        taken.add(digest)


def downgrade() -> None:
    # the hash only finds re-uploads of stored content; the older rule cannot be restored exactly
    # for rows stored under this one, and nothing else reads it
    pass
