#!/usr/bin/env bash
# Start one Kafka node (KRaft) configured from the environment, with the official image's convention:
# every KAFKA_<NAME> variable becomes the property <name>, lower-cased, with '___' → '-', '__' → '_'
# and '_' → '.' (KAFKA_LISTENER_SECURITY_PROTOCOL_MAP → listener.security.protocol.map).
# KAFKA_HEAP_OPTS and KAFKA_OPTS go to the JVM instead; KAFKA_HEALTHCHECK_* to healthcheck.py. CLUSTER_ID formats the storage on the first
# start (a restarted container keeps its data and is not formatted again). RLBUS_KAFKA_EXTRA_PROPERTIES
# names a properties file appended as is: what must not sit in the environment (a keystore's password;
# docker-compose.secure.yml mounts one per broker, written by `rlbus secrets issue`).
set -euo pipefail
config="${RLBUS_KAFKA_PROPERTIES:-/var/lib/kafka/server.properties}"  # not KAFKA_*: that would be a property
: "${CLUSTER_ID:?set CLUSTER_ID (any Kafka uuid, the same on every node of the cluster)}"
: "${KAFKA_NODE_ID:?set KAFKA_NODE_ID}"
export KAFKA_LOG_DIRS="${KAFKA_LOG_DIRS:-/var/lib/kafka/data}"

{
  echo "# written by /opt/kafka/entrypoint.sh from the container's KAFKA_* environment"
  while IFS='=' read -r name value; do
    case "$name" in KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_HEALTHCHECK_*) continue ;; esac
    key="${name#KAFKA_}"
    key="${key,,}"
    key="${key//___/-}"
    key="${key//__/@}"
    key="${key//_/.}"
    echo "${key//@/_}=$value"
  done < <(env | grep '^KAFKA_' | sort)
  if [[ -n "${RLBUS_KAFKA_EXTRA_PROPERTIES:-}" ]]; then
    echo "# from $RLBUS_KAFKA_EXTRA_PROPERTIES"
    cat "$RLBUS_KAFKA_EXTRA_PROPERTIES"
  fi
} >"$config"
chmod 600 "$config"

java_cmd=(java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx1g} -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
  ${KAFKA_OPTS:-} -Dlog4j2.configurationFile=/opt/kafka/log4j2-container.properties -cp '/opt/kafka/libs/*')
if [[ ! -f "$KAFKA_LOG_DIRS/meta.properties" ]]; then
  "${java_cmd[@]}" kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$config" --ignore-formatted
fi
exec "${java_cmd[@]}" kafka.Kafka "$config"
