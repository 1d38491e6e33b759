"""The server side: the ASGI app and its routes (`create_app`), the proxied endpoint that runs a
request through the pipeline, uvicorn's protocol with the limits it lacks, the one response
writer every answer leaves through, the OpenAPI document and the admin status."""
