"""``selfspec serve``: an OpenAI-compatible HTTP server over one model, with a chat playground at ``/``.

    selfspec serve --model smollm2-135m --port 8000
    # then, from any OpenAI client:
    #   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(...)

Modules, in the order a request meets them: :mod:`.schemas` (request bodies
validated into generation jobs, OpenAI-style errors), :mod:`.app` (the routes,
SSE streaming, authentication, limits), :mod:`.worker` (one generation at a
time from a bounded queue, the learned state kept across requests and saved),
:mod:`.metrics` (Prometheus text).  Requests are decoded one at a time in
arrival order: our methods decode a batch of one.
"""
