"""The OpenAI-compatible gateway and served-traffic recording (`rlbus serve`).

``gateway`` (routes and the trainer-side contract), ``call`` (one request as the gateway plays it),
``responses`` (choice bodies, headers, version labels), ``streaming`` (server-sent events), ``records``
(what a completion is recorded as), ``api`` (the OpenAI wire format, its field policy and error bodies),
``openai_responses`` (the Responses API, translated into the chat request the gateway plays),
``auth`` (tenant tokens), ``prompt`` (messages → ids, earlier turns mapped to sampled ids), ``sessions``
(agent sessions → rollouts), ``admission`` (429s for RL sessions), ``recorder`` (buffered writes to
``rl.served.v1``), ``stack`` (the wiring over a rollout stack).
"""
