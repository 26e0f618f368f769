"""Least privilege for a deployment: what each role may do, the credentials that say so, and a probe of it.

``kafka_acl`` (one Kafka principal per role and namespace, and its ACLs), ``redis_acl`` (one Redis ACL user per
role), ``kafka_broker`` (a secure broker's TLS, SCRAM and authorizer settings), ``tls`` (a certificate authority on
openssl), ``credentials`` (``rlbus secrets issue``: a container deployment's credentials, one directory per role)
and ``probe`` (``rlbus secrets probe``: a deployed role tries what it must not do). Starting a secure *local*
cluster and granting on it belong to the tooling (:mod:`rlbus_tools.services.kafka_secure`).
"""
