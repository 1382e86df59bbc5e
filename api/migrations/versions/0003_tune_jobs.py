"""tune_jobs: the service's ``autopar tune`` jobs (POST /v1/tune), their progress and outcome

``slot`` is 1 while a job is queued or running and NULL after; its unique constraint admits one active
job at a time.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('tune_jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('slot', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('profile_id', sa.Integer(), nullable=False),
    sa.Column('cluster', sa.String(length=200), nullable=False),
    sa.Column('model_name', sa.String(length=200), nullable=False),
    sa.Column('request', sa.JSON(), nullable=False),
    sa.Column('owner', sa.String(length=300), nullable=True),
    sa.Column('workdir', sa.Text(), nullable=True),
    sa.Column('phase', sa.String(length=16), nullable=True),
    sa.Column('done', sa.Integer(), nullable=False),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('log', sa.JSON(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('runs', sa.JSON(), nullable=True),
    sa.Column('calibrated_profile_id', sa.Integer(), nullable=True),
    sa.Column('replanned_plan_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['calibrated_profile_id'], ['profiles.id'], ),
    sa.ForeignKeyConstraint(['profile_id'], ['profiles.id'], ),
    sa.ForeignKeyConstraint(['replanned_plan_id'], ['plans.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('slot')
    )
    with op.batch_alter_table('tune_jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tune_jobs_cluster'), ['cluster'], unique=False)
        batch_op.create_index(batch_op.f('ix_tune_jobs_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_tune_jobs_profile_id'), ['profile_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_tune_jobs_state'), ['state'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('tune_jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tune_jobs_state'))
        batch_op.drop_index(batch_op.f('ix_tune_jobs_profile_id'))
        batch_op.drop_index(batch_op.f('ix_tune_jobs_created_at'))
        batch_op.drop_index(batch_op.f('ix_tune_jobs_cluster'))

    op.drop_table('tune_jobs')
