"""Blob stores: immutable bytes by key, for weight chunks and claim-checked messages.

``base`` holds the contract and the key rules, ``local`` the directory store, ``http`` the signed HTTP
server, client and regional relay, ``open`` the one function that opens a store by URL. The package sits
below the bus (claim checks put large values here) and the weights (published versions live here).
"""
