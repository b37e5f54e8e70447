"""Scale-out on Ray Serve (the ``ray`` extra): N engine replicas behind the OpenAI routes.

- ``options.py``: ``pagedllm serve --replicas/--max-replicas/...`` and the replica plan (no Ray);
- ``app.py``: the application, ``pagedllm serve --replicas N`` and ``app_builder`` for ``serve run``;
- ``default_app.py``: the default application as an object, for ``serve build``;
- ``replica.py``: ``EngineReplica``, one ``AsyncLLMEngine`` per replica;
- ``ingress.py``: ``OpenAIIngress``, ``build_app``'s routes as the HTTP ingress;
- ``engine_client.py``: ``RayEngineClient``, the replicas as the routes' ``EngineClient``;
- ``router.py``: ``PrefixAwareRequestRouter``, prefix- and load-aware replica choice;
- ``prefix_index.py``: process-independent prefix block keys and a bounded LRU of them.
"""
