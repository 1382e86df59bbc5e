"""runs.report_hash and plans.idempotency_key: a retried POST never stores twice

The same run report posted twice for a plan is stored once; a plan request carrying an Idempotency-Key that
was seen before is answered with the plan stored for it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('report_hash', sa.String(length=64), nullable=True))
        batch.create_unique_constraint('uq_runs_plan_report', ['plan_id', 'report_hash'])
    with op.batch_alter_table('plans') as batch:
        batch.add_column(sa.Column('idempotency_key', sa.String(length=200), nullable=True))
        batch.create_unique_constraint('uq_plans_idempotency_key', ['idempotency_key'])


def downgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.drop_constraint('uq_plans_idempotency_key', type_='unique')
        batch.drop_column('idempotency_key')
    with op.batch_alter_table('runs') as batch:
        batch.drop_constraint('uq_runs_plan_report', type_='unique')
        batch.drop_column('report_hash')
