"""The application with ``pagedllm serve``'s defaults and one replica, as an object: what
``serve build`` needs (it takes an ``Application``, not a builder).

    serve build pagedllm.serve_ray.default_app:app -o serve_config.yaml

writes a config with every deployment's settings to edit and ``serve deploy``. To pass options,
point the config's ``import_path`` at ``pagedllm.serve_ray.app:app_builder`` and give them as
``args`` (each key is a ``pagedllm serve`` option without its dashes), as
``deploy/kubernetes/ray/rayservice.yaml`` does.
"""

from pagedllm.serve_ray.app import app_builder

app = app_builder({"replicas": "1"})
