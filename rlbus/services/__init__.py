"""Local services for development and CI: Apache Kafka and Redis, run from plain processes.

Developers and CI machines often have Java and the Debian packages but no Docker engine, so these
modules start the real servers directly: ``kafka`` runs a KRaft cluster from the Maven Central jars
pinned in ``infra/kafka/pom.xml``; ``redis`` runs the system ``redis-server``. Each raises
:class:`rlbus.errors.ServiceError` with the server's own words when something goes wrong.
"""
