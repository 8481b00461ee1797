{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's base name; the RayCluster is called this, so its head Service is <fullname>-head-svc. KubeRay
names pods <cluster>-<group>-..., so keep it short (the schema caps it too). */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "tandem.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "tandem.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The id clients name the model by (router/router_actor.py model_id_for): the folder or file name. */}}
{{- define "tandem.modelId" -}}
{{- if eq .Values.model.path "embedded" }}SmolLM2-135M-Instruct{{ else }}{{ base .Values.model.path | trimSuffix ".gguf" | splitList ".Q" | first }}{{ end -}}
{{- end -}}

{{- define "tandem.headService" -}}
{{- printf "%s-head-svc.%s.svc.cluster.local:6379" (include "tandem.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "tandem.apiKeySecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-api-keys" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.tlsSecret" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.authEnabled" -}}
{{- if or .Values.auth.apiKeys .Values.auth.existingSecret }}true{{ end -}}
{{- end -}}

{{/* The pools the manifest has, in order: [prefill] decode. */}}
{{- define "tandem.poolNames" -}}
{{- if and (eq .Values.mode "disaggregated") .Values.pools.prefill.enabled }}prefill {{ end }}decode
{{- end -}}

{{/* One pool's placement on its node group, as YAML (fromYaml it): worldSize (ranks per replica), ranksPerNode
(how many of its ranks one pod of its group holds: the Ray resource tandem_<pool> the pod offers),
replicasPerNode, and the pods its replicas.min / initial / max need (fractions: pools that share a node group
share its pods, and the group's counts are the sums rounded up). Fails, naming the values to change, when one
replica does not fit on one node. Call with (dict "root" $ "pool" NAME). */}}
{{- define "tandem.poolPlan" -}}
{{- $root := .root -}}
{{- $name := .pool -}}
{{- $pool := index $root.Values.pools $name -}}
{{- $group := index $root.Values.nodeGroups $pool.nodeGroup -}}
{{- $p := $pool.parallelism -}}
{{- $world := mul (int $p.tp) (int $p.pp) (int $p.ep) -}}
{{- $gpus := float64 $pool.resources.gpus -}}
{{- $cpus := float64 $pool.resources.cpus -}}
{{- $byGpu := 1000000.0 -}}
{{- if gt $gpus 0.0 -}}
{{- $byGpu = floor (divf (float64 $group.gpus) $gpus) -}}
{{- end -}}
{{- $byCpu := 1000000.0 -}}
{{- if gt $cpus 0.0 -}}
{{- $byCpu = floor (divf (float64 $group.cpus) $cpus) -}}
{{- end -}}
{{- $ranksPerNode := int (min (int64 $byGpu) (int64 $byCpu)) -}}
{{- if lt $ranksPerNode $world -}}
{{- fail (printf "pools.%s: one replica is tp x pp x ep = %d ranks on one node, each asking %v GPU(s) and %v CPU(s) (pools.%s.resources): %v GPU(s) and %v CPU(s), but a node of group %q has nodeGroups.%s.gpus %v and cpus %v. Lower the pool's parallelism or resources, or use larger nodes" $name $world $gpus $cpus $name (mulf $gpus $world) (mulf $cpus $world) $pool.nodeGroup $pool.nodeGroup $group.gpus $group.cpus) -}}
{{- end -}}
{{- $perNode := div $ranksPerNode $world -}}
{{- $r := $pool.replicas -}}
{{- $initial := max $r.min 1 -}}{{/* as the manifest's Replicas.start: initial when given (0 included) */}}
{{- if not (kindIs "invalid" $r.initial) }}{{ $initial = $r.initial }}{{ end -}}
worldSize: {{ $world }}
ranksPerNode: {{ $ranksPerNode }}
replicasPerNode: {{ $perNode }}
minNodes: {{ divf $r.min $perNode }}
initialNodes: {{ divf $initial $perNode }}
maxNodes: {{ divf $r.max $perNode }}
{{- end -}}

{{/* Checks across values that values.schema.json cannot express; each fails the install with what to change. */}}
{{- define "tandem.validate" -}}
{{- $v := .Values -}}
{{- if and (eq $v.mode "disaggregated") (not $v.pools.prefill.enabled) -}}
{{- fail "mode is disaggregated but pools.prefill.enabled is false: enable the prefill pool, or set mode: colocated" -}}
{{- end -}}
{{- if and (eq $v.mode "colocated") $v.pools.prefill.enabled -}}
{{- fail "mode is colocated (the decode pool's replicas prefill for themselves): set pools.prefill.enabled: false" -}}
{{- end -}}
{{- if and (eq $v.model.path "embedded") (ne $v.image.variant "cpu") -}}
{{- fail "model.path is embedded, which only the cpu image carries: set image.variant: cpu, or give the path of a model on model.volume" -}}
{{- end -}}
{{- if and (ne $v.model.path "embedded") (not $v.model.volume) -}}
{{- fail (printf "model.path is %q but model.volume is empty: no model is baked into the image; give the volume that holds it (e.g. persistentVolumeClaim: {claimName: models})" $v.model.path) -}}
{{- end -}}
{{- if and (ne $v.model.path "embedded") (not (hasPrefix (printf "%s/" (trimSuffix "/" $v.model.mountPath)) $v.model.path)) -}}
{{- fail (printf "model.path %q is not inside model.mountPath %q, where the model volume is mounted" $v.model.path $v.model.mountPath) -}}
{{- end -}}
{{- range $name := include "tandem.poolNames" . | splitList " " -}}
{{- $pool := index $v.pools $name -}}
{{- $r := $pool.replicas -}}
{{- if gt (int $r.min) (int $r.max) -}}
{{- fail (printf "pools.%s.replicas: min (%v) is more than max (%v)" $name $r.min $r.max) -}}
{{- end -}}
{{- if and (hasKey $r "initial") (not (kindIs "invalid" $r.initial)) -}}
{{- if or (lt (int $r.initial) (int $r.min)) (gt (int $r.initial) (int $r.max)) -}}
{{- fail (printf "pools.%s.replicas.initial (%v) must lie between min (%v) and max (%v)" $name $r.initial $r.min $r.max) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (float64 $pool.resources.gpus) 0.0) (eq $v.image.variant "cpu") -}}
{{- fail (printf "pools.%s.resources.gpus is %v but image.variant is cpu (CPU torch): use the cuda image, or gpus: 0" $name $pool.resources.gpus) -}}
{{- end -}}
{{- if not (hasKey $v.nodeGroups $pool.nodeGroup) -}}
{{- fail (printf "pools.%s.nodeGroup is %q, which nodeGroups does not define (it has: %s)" $name $pool.nodeGroup (keys $v.nodeGroups | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $group := index $v.nodeGroups $pool.nodeGroup -}}
{{- if and (gt (float64 $pool.resources.gpus) 0.0) (not $group.gpus) -}}
{{- fail (printf "pools.%s asks for GPUs but its node group %q has gpus: 0" $name $pool.nodeGroup) -}}
{{- end -}}
{{- $_ := include "tandem.poolPlan" (dict "root" $ "pool" $name) -}}
{{- end -}}
{{- if and $v.auth.apiKeys $v.auth.existingSecret -}}
{{- fail "give API keys one way: auth.apiKeys (the chart writes a Secret) or auth.existingSecret, not both" -}}
{{- end -}}
{{- if and $v.auth.existingSecret (not $v.auth.tenantNames) -}}
{{- fail "auth.existingSecret needs auth.tenantNames: the tenants (the Secret's data keys) whose keys to read" -}}
{{- end -}}
{{- range $tenant, $_ := $v.auth.tenants -}}
{{- $named := list -}}
{{- range $v.auth.apiKeys }}{{ $named = append $named .tenant }}{{ end -}}
{{- range $v.auth.tenantNames }}{{ $named = append $named . }}{{ end -}}
{{- if not (has $tenant $named) -}}
{{- fail (printf "auth.tenants names %q, which no API key authenticates as (auth.apiKeys / auth.tenantNames)" $tenant) -}}
{{- end -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- if not (or $v.tls.secretName (and $v.tls.cert $v.tls.key)) -}}
{{- fail "tls.enabled needs tls.secretName (a kubernetes.io/tls Secret) or tls.cert and tls.key (PEM)" -}}
{{- end -}}
{{- if and $v.tls.requireClientCerts (not (or $v.tls.secretName $v.tls.clientCA)) -}}
{{- fail "tls.requireClientCerts needs the client CA: tls.clientCA (PEM), or ca.crt in tls.secretName" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The tandem manifest (deploy/manifests format) this release runs, from the values. */}}
{{- define "tandem.manifest" -}}
{{- $v := .Values -}}
{{- $pools := dict -}}
{{- range $name := include "tandem.poolNames" . | splitList " " -}}
{{- $pool := index $v.pools $name -}}
{{- $resources := dict "cpus" $pool.resources.cpus "gpus" $pool.resources.gpus "custom" (dict (printf "tandem_%s" $name) 1) -}}
{{- $replicas := dict "min" $pool.replicas.min "max" $pool.replicas.max -}}
{{- if not (kindIs "invalid" $pool.replicas.initial) }}{{ $_ := set $replicas "initial" $pool.replicas.initial }}{{ end -}}
{{- $entry := dict "parallelism" $pool.parallelism "resources" $resources "replicas" $replicas -}}
{{- if $pool.engine }}{{ $_ := set $entry "engine" $pool.engine }}{{ end -}}
{{- if $pool.autoscaling }}{{ $_ := set $entry "autoscaling" $pool.autoscaling }}{{ end -}}
{{- $_ := set $pools $name $entry -}}
{{- end -}}
{{- $manifest := dict "name" "tandem" "model" $v.model.path "mode" $v.mode -}}
{{- $_ := set $manifest "ray" (dict "address" "auto" "namespace" "tandem") -}}
{{- $_ := set $manifest "pools" $pools -}}
{{- $_ := set $manifest "slo" $v.slo -}}
{{- if $v.router }}{{ $_ := set $manifest "router" $v.router }}{{ end -}}
{{- if $v.transport }}{{ $_ := set $manifest "transport" $v.transport }}{{ end -}}
{{- $_ := set $manifest "listen" (dict "grpc" "0.0.0.0:50051" "http" "0.0.0.0:8000") -}}
{{- $auth := dict -}}
{{- $keys := list -}}
{{- range $v.auth.apiKeys }}{{ $keys = append $keys (dict "tenant" .tenant "key_file" (printf "/etc/tandem/api-keys/%s" .tenant)) }}{{ end -}}
{{- range $v.auth.tenantNames }}{{ $keys = append $keys (dict "tenant" . "key_file" (printf "/etc/tandem/api-keys/%s" .)) }}{{ end -}}
{{- if $keys }}{{ $_ := set $auth "api_keys" $keys }}{{ end -}}
{{- if $v.auth.tenants }}{{ $_ := set $auth "tenants" $v.auth.tenants }}{{ end -}}
{{- if $auth }}{{ $_ := set $manifest "auth" $auth }}{{ end -}}
{{- if $v.tls.enabled -}}
{{- $tls := dict "cert_file" "/etc/tandem/tls/tls.crt" "key_file" "/etc/tandem/tls/tls.key" -}}
{{- if $v.tls.requireClientCerts }}{{ $_ := set $tls "client_ca_file" "/etc/tandem/tls/ca.crt" }}{{ end -}}
{{- $_ := set $manifest "tls" $tls -}}
{{- end -}}
{{- toYaml $manifest -}}
{{- end -}}

{{/* Volumes every tandem pod has: the model (read-only), /dev/shm. */}}
{{- define "tandem.modelVolumes" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMounts" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .size }}
{{- end -}}

{{/* What the control pod's containers read: the manifest, API keys, TLS files, Ray's session folder (the ray
container's raylet and `tandem up`'s driver share it), the model. */}}
{{- define "tandem.controlVolumes" -}}
- name: manifest
  configMap:
    name: {{ include "tandem.fullname" . }}-manifest
- name: ray-session
  emptyDir: {}
{{- if include "tandem.authEnabled" . }}
- name: api-keys
  secret:
    secretName: {{ include "tandem.apiKeySecret" . }}
    defaultMode: 0440
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tandem.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- include "tandem.modelVolumes" . }}
{{ include "tandem.shmVolume" (dict "size" "2Gi") }}
{{- end -}}

{{- define "tandem.controlMounts" -}}
- name: manifest
  mountPath: /etc/tandem/manifest
  readOnly: true
- name: ray-session
  mountPath: /tmp/ray
{{- if include "tandem.authEnabled" . }}
- name: api-keys
  mountPath: /etc/tandem/api-keys
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- include "tandem.modelMounts" . }}
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{/* Every Ray container's environment. Pods that ask for no GPU get NVIDIA_VISIBLE_DEVICES=void: the cuda image
sets it to all, which on a node whose default container runtime is NVIDIA's would show such a pod every GPU of
its node. Call with (dict "gpus" N). */}}
{{/* The Secret holding Ray's authentication token (data key auth_token). */}}
{{- define "tandem.rayAuthSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "tandem.fullname" .)) -}}
{{- end -}}

{{/* Every Ray container's environment: usage stats off, Ray's token authentication from the Secret (rayAuth),
NVIDIA's devices hidden from a pod that asks for no GPU. Takes (dict "gpus" N "root" $). */}}
{{- define "tandem.rayEnv" -}}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- if .root.Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "tandem.rayAuthSecret" .root }}, key: auth_token}
{{- end }}
{{- if not .gpus }}
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end }}
{{- end -}}

{{/* The node groups some enabled pool uses, with what each offers and its pod counts, as YAML (fromYaml it):
{GROUP: {offers: {tandem_POOL: ranks}, minReplicas, replicas, maxReplicas}}. A group no pool names is left out. */}}
{{- define "tandem.nodeGroupPlans" -}}
{{- $plans := dict -}}
{{- range $group, $_ := .Values.nodeGroups -}}
{{- $offers := dict -}}
{{- $min := 0.0 -}}{{- $initial := 0.0 -}}{{- $max := 0.0 -}}
{{- range $pool := include "tandem.poolNames" $ | splitList " " -}}
{{- if eq (index $.Values.pools $pool).nodeGroup $group -}}
{{- $plan := include "tandem.poolPlan" (dict "root" $ "pool" $pool) | fromYaml -}}
{{- $_ := set $offers (printf "tandem_%s" $pool) $plan.ranksPerNode -}}
{{- $min = addf $min $plan.minNodes -}}{{- $initial = addf $initial $plan.initialNodes -}}{{- $max = addf $max $plan.maxNodes -}}
{{- end -}}
{{- end -}}
{{- if $offers -}}
{{- $_ := set $plans $group (dict "offers" $offers "minReplicas" (ceil $min | int) "replicas" (ceil $initial | int) "maxReplicas" (ceil $max | int)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $plans -}}
{{- end -}}

{{/* The control pod's termination grace: preStop's pause, the router's drain (router.drain_timeout_s, default 30)
and 45 s to stop the replicas and the Ray node. */}}
{{- define "tandem.terminationGraceSeconds" -}}
{{- $drain := .Values.router.drain_timeout_s | default 30 | int -}}
{{- add .Values.control.preStopSeconds $drain 45 -}}
{{- end -}}
