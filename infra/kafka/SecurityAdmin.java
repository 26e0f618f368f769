// rlbus's security set-up through Kafka's own Admin API (org.apache.kafka.clients.admin.Admin), in one JVM.
//
// rlbus.security.kafka_acl compiles this file once per Kafka release into the jar cache and runs it with the
// broker's classpath. It reads one JSON request on stdin, so no password is ever a command-line argument:
//
//   {"client": {admin client properties},
//    "scram": [{"user": "run7.trainer", "mechanism": "SCRAM-SHA-512", "iterations": 8192, "password": "..."}],
//    "delete_scram": [{"user": "...", "mechanism": "SCRAM-SHA-512"}],
//    "acls": [{"principal": "User:run7.trainer", "resource_type": "TOPIC", "name": "run7.rl.weights.v1",
//              "pattern": "LITERAL", "operation": "WRITE", "permission": "ALLOW", "host": "*"}],
//    "delete_acls": [same shape as acls],
//    "describe_acls": true}
//
// and writes one JSON answer on stdout: {"scram": [{"user", "error"}], "acls": [{"binding", "error"}],
// "deleted_acls": n, "described": [bindings]}. An entry's "error" is null when the broker accepted it. The JVM
// exits 0 when every entry was accepted, 2 when some were refused (the answer says which), 1 when the request
// could not be sent at all (stderr says why).
//
// Why not kafka-acls / kafka-configs: each of those is one JVM start per resource pattern and per user, about
// two seconds each on a small machine; a namespace's credentials are a dozen of each.

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.CreateAclsResult;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialAlteration;
import org.apache.kafka.clients.admin.UserScramCredentialDeletion;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;
import org.apache.kafka.common.KafkaFuture;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclBindingFilter;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public final class SecurityAdmin {
    private static final long TIMEOUT_S = 60;

    public static void main(String[] args) throws Exception {
        ObjectMapper json = new ObjectMapper();
        JsonNode request = json.readTree(System.in);
        Properties props = new Properties();
        Iterator<Map.Entry<String, JsonNode>> client = request.path("client").fields();
        while (client.hasNext()) {
            Map.Entry<String, JsonNode> entry = client.next();
            props.put(entry.getKey(), entry.getValue().asText());
        }
        ObjectNode answer = json.createObjectNode();
        boolean refused = false;
        try (Admin admin = Admin.create(props)) {
            refused |= scram(admin, request, answer.putArray("scram"));
            refused |= createAcls(admin, request.path("acls"), answer.putArray("acls"));
            answer.put("deleted_acls", deleteAcls(admin, request.path("delete_acls")));
            if (request.path("describe_acls").asBoolean(false)) {
                ArrayNode described = answer.putArray("described");
                for (AclBinding binding : admin.describeAcls(AclBindingFilter.ANY).values().get(TIMEOUT_S, TimeUnit.SECONDS)) {
                    described.add(toJson(json, binding));
                }
            }
        } catch (ExecutionException e) {
            System.err.println(e.getCause().getClass().getSimpleName() + ": " + e.getCause().getMessage());
            System.exit(1);
        }
        System.out.println(json.writeValueAsString(answer));
        System.exit(refused ? 2 : 0);
    }

    private static boolean scram(Admin admin, JsonNode request, ArrayNode out) throws Exception {
        List<UserScramCredentialAlteration> alterations = new ArrayList<>();
        for (JsonNode user : request.path("scram")) {
            ScramMechanism mechanism = ScramMechanism.fromMechanismName(user.path("mechanism").asText("SCRAM-SHA-512"));
            alterations.add(new UserScramCredentialUpsertion(
                    user.path("user").asText(),
                    new ScramCredentialInfo(mechanism, user.path("iterations").asInt(8192)),
                    user.path("password").asText()));
        }
        for (JsonNode user : request.path("delete_scram")) {
            ScramMechanism mechanism = ScramMechanism.fromMechanismName(user.path("mechanism").asText("SCRAM-SHA-512"));
            alterations.add(new UserScramCredentialDeletion(user.path("user").asText(), mechanism));
        }
        if (alterations.isEmpty()) {
            return false;
        }
        boolean refused = false;
        for (Map.Entry<String, KafkaFuture<Void>> result : admin.alterUserScramCredentials(alterations).values().entrySet()) {
            ObjectNode row = out.addObject();
            row.put("user", result.getKey());
            String error = errorOf(result.getValue());
            row.put("error", error);
            refused |= error != null;
        }
        return refused;
    }

    private static boolean createAcls(Admin admin, JsonNode acls, ArrayNode out) throws Exception {
        List<AclBinding> bindings = new ArrayList<>();
        for (JsonNode acl : acls) {
            bindings.add(binding(acl));
        }
        if (bindings.isEmpty()) {
            return false;
        }
        boolean refused = false;
        CreateAclsResult result = admin.createAcls(bindings);
        for (Map.Entry<AclBinding, KafkaFuture<Void>> entry : result.values().entrySet()) {
            ObjectNode row = out.addObject();
            row.put("binding", entry.getKey().toString());
            String error = errorOf(entry.getValue());
            row.put("error", error);
            refused |= error != null;
        }
        return refused;
    }

    private static int deleteAcls(Admin admin, JsonNode acls) throws Exception {
        List<AclBindingFilter> filters = new ArrayList<>();
        for (JsonNode acl : acls) {
            filters.add(binding(acl).toFilter());
        }
        if (filters.isEmpty()) {
            return 0;
        }
        return admin.deleteAcls(filters).all().get(TIMEOUT_S, TimeUnit.SECONDS).size();
    }

    private static AclBinding binding(JsonNode acl) {
        ResourcePattern pattern = new ResourcePattern(
                ResourceType.fromString(acl.path("resource_type").asText()),
                acl.path("name").asText(),
                PatternType.fromString(acl.path("pattern").asText("LITERAL")));
        AccessControlEntry entry = new AccessControlEntry(
                acl.path("principal").asText(),
                acl.path("host").asText("*"),
                AclOperation.fromString(acl.path("operation").asText()),
                AclPermissionType.fromString(acl.path("permission").asText("ALLOW")));
        if (pattern.resourceType() == ResourceType.UNKNOWN || entry.operation() == AclOperation.UNKNOWN
                || pattern.patternType() == PatternType.UNKNOWN || entry.permissionType() == AclPermissionType.UNKNOWN) {
            throw new IllegalArgumentException("unknown resource type, pattern, operation or permission in " + acl);
        }
        return new AclBinding(pattern, entry);
    }

    private static ObjectNode toJson(ObjectMapper json, AclBinding binding) {
        ObjectNode row = json.createObjectNode();
        row.put("principal", binding.entry().principal());
        row.put("resource_type", binding.pattern().resourceType().name());
        row.put("name", binding.pattern().name());
        row.put("pattern", binding.pattern().patternType().name());
        row.put("operation", binding.entry().operation().name());
        row.put("permission", binding.entry().permissionType().name());
        row.put("host", binding.entry().host());
        return row;
    }

    private static String errorOf(KafkaFuture<Void> future) throws InterruptedException {
        try {
            future.get(TIMEOUT_S, TimeUnit.SECONDS);
            return null;
        } catch (ExecutionException e) {
            return e.getCause().getClass().getSimpleName() + ": " + e.getCause().getMessage();
        } catch (java.util.concurrent.TimeoutException e) {
            return "TimeoutException: no answer in " + TIMEOUT_S + " s";
        }
    }
}
