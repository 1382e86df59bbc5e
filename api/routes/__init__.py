"""The JSON API, one router per resource: health probes, model presets, profiles (and their clusters),
plans, runs, tune jobs. ``create_app`` includes :data:`ROUTERS` in this order."""

from api.routes import health, plans, presets, profiles, runs, tune

ROUTERS = (health.router, presets.router, profiles.router, plans.router, runs.router, tune.router)
