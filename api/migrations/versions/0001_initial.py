"""initial schema: clusters, profiles, plans, runs

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('clusters',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('profiles',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('cluster_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('gpu_name', sa.String(length=200), nullable=False),
    sa.Column('gpus_per_node', sa.Integer(), nullable=False),
    sa.Column('num_nodes', sa.Integer(), nullable=False),
    sa.Column('measured_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('uploaded_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('body', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('cluster_id', 'version', name='uq_profile_version'),
    sa.UniqueConstraint('content_hash')
    )
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_profiles_cluster_id'), ['cluster_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_profiles_gpu_name'), ['gpu_name'], unique=False)
        batch_op.create_index(batch_op.f('ix_profiles_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_profiles_measured_at'), ['measured_at'], unique=False)

    op.create_table('plans',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('profile_id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('model_name', sa.String(length=200), nullable=False),
    sa.Column('num_gpus', sa.Integer(), nullable=False),
    sa.Column('step_time_s', sa.Float(), nullable=True),
    sa.Column('request', sa.JSON(), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=True),
    sa.Column('explanation', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['profile_id'], ['profiles.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('plans', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_plans_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_plans_model_name'), ['model_name'], unique=False)
        batch_op.create_index(batch_op.f('ix_plans_profile_id'), ['profile_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_plans_request_hash'), ['request_hash'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('plan_id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('predicted_step_s', sa.Float(), nullable=True),
    sa.Column('measured_step_s', sa.Float(), nullable=False),
    sa.Column('report', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['plan_id'], ['plans.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_plan_id'), ['plan_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_plan_id'))
        batch_op.drop_index(batch_op.f('ix_runs_created_at'))

    op.drop_table('runs')
    with op.batch_alter_table('plans', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_plans_request_hash'))
        batch_op.drop_index(batch_op.f('ix_plans_profile_id'))
        batch_op.drop_index(batch_op.f('ix_plans_model_name'))
        batch_op.drop_index(batch_op.f('ix_plans_created_at'))

    op.drop_table('plans')
    with op.batch_alter_table('profiles', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_profiles_measured_at'))
        batch_op.drop_index(batch_op.f('ix_profiles_kind'))
        batch_op.drop_index(batch_op.f('ix_profiles_gpu_name'))
        batch_op.drop_index(batch_op.f('ix_profiles_cluster_id'))

    op.drop_table('profiles')
    op.drop_table('clusters')
