"""The ClientApp component a deployment runs (``[tool.flwr.app.components]`` of the generated app).

``client_app`` is the project's ClientApp (:data:`fedprivacy.fl.client_app.app`, with whatever mods
it carries, reading its config from the run config) wrapped in the resource measurement of
:mod:`fedprivacy.deploy.resources`. The server component is :data:`fedprivacy.fl.server_app.app`
itself. These are the apps the in-process and Ray engines run, so every engine runs the same code.
"""

from fedprivacy.deploy.resources import MeasuredClientApp
from fedprivacy.fl.client_app import app as _client_app

client_app = MeasuredClientApp(_client_app)
