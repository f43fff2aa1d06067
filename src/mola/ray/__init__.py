"""mola on Ray Serve: replicas of one mola configuration behind an ingress
that routes each request to a replica already holding its adapter (Ray
Serve's model multiplexing). Needs the ``ray`` extra (``pip install
'mola[ray]'``); nothing here is imported by `mola serve` without
``--replicas``.

    asgi.py         one raw request through mola's own app, answered piece by piece (no Ray)
    failures.py     what the ingress answers when a replica fails a request (no Ray)
    deployments.py  the ingress and replica deployments
    app.py          the bound application, and `serve run`'s builder
    launch.py       starting Ray and the application, bounded in time
"""
