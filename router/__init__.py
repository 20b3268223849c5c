"""Kvasir's router (`kvasir router`): an OpenAI-compatible reverse proxy in front of several
`kvasir serve` replicas that sends each request where its prompt's prefix is cached and the queue
is short. See docs/routing.md. Torch-free: the router image carries no model code."""
