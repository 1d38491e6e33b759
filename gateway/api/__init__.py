"""The OpenAI API as the gateway reads it: the table of endpoint kinds (path, body checks, what
is hashed, how tokens are counted), request parsing, multipart uploads, and the taps that read
a streamed answer's usage and ids as it is relayed."""
