"""Who may send what: tenants and their keys, token-bucket rate limits (memory or Redis), the
admission queue by priority class, and the memory budgets for bodies and answers in flight."""
