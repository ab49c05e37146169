"""What built each step's prompt: exact continuation or the chat template.

``steps.continuation`` is "exact" (the extended turn's own prompt and sampled ids, then the
template's rendering of only the new messages and the generation prompt) or "template" (the whole
conversation rendered by the template); ``steps.suffix_tokens`` how many tokens the template
rendered in exact mode. Both NULL on rows written before (and on calls the gateway does not
render, such as completions prompts).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("continuation", sa.String(16), nullable=True))
        batch.add_column(sa.Column("suffix_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("suffix_tokens")
        batch.drop_column("continuation")
