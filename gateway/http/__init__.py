"""The server's face: the ASGI app and its routes (`create_app`), the proxied endpoint that runs a
request through the pipeline, the OpenAPI document and the admin status. The wire below it (the
protocol, the response writer) is gateway/transport/."""
