"""Client programs of the client matrix (tests/integration/test_clients.py): each runs under the client
environment's python (.venv-clients, `make clients-env`), as a user of that framework writes it."""
