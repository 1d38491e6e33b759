"""A request's steps (`steps.Pipeline`: parse, identify, pick pool, limit, route, admit, forward,
finish), its per-request `Record` and how it is recorded, and the by-id /v1/responses forwards."""
