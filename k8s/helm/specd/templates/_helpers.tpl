{{/* Names */}}

{{- define "specd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object-name prefix: the release name when it already contains the chart name. */}}
{{- define "specd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: "<fullname>-<component>". Call with (list $ "draft"). */}}
{{- define "specd.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "specd.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels. Call with (list $ "component"). */}}
{{- define "specd.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "specd.chart" $root }}
{{ include "specd.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: specd
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end -}}

{{- define "specd.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "specd.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "specd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "specd.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.device) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "specd.tlsSecret" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "specd.fullname" .)) -}}
{{- end -}}

{{- define "specd.clientTlsSecret" -}}
{{- .Values.tls.clientSecretName | default (printf "%s-client-tls" (include "specd.fullname" .)) -}}
{{- end -}}

{{- define "specd.apiTokenSecret" -}}
{{- .Values.apiToken.existingSecret | default (printf "%s-api-token" (include "specd.fullname" .)) -}}
{{- end -}}

{{- define "specd.rayClusterName" -}}
{{- include "specd.componentName" (list . "ray") -}}
{{- end -}}

{{/* The OTLP endpoint: the configured one, else the bundled Jaeger, else none. */}}
{{- define "specd.otlpEndpoint" -}}
{{- if .Values.telemetry.otlpEndpoint -}}
{{- .Values.telemetry.otlpEndpoint -}}
{{- else if .Values.jaeger.enabled -}}
{{- printf "http://%s:4317" (include "specd.componentName" (list . "jaeger")) -}}
{{- end -}}
{{- end -}}

{{/* Sanity checks that the schema cannot express. */}}
{{- define "specd.validate" -}}
{{- if and (eq .Values.target.executor "ray") (ne (int .Values.target.tp) (add1 (mul (int .Values.target.ray.worker.replicas) (int .Values.target.ray.worker.gpusPerWorker)))) -}}
{{- fail (printf "target.tp (%v) must equal 1 + target.ray.worker.replicas x gpusPerWorker (1 + %v x %v) with executor ray: rank 0 runs in the target pod" .Values.target.tp .Values.target.ray.worker.replicas .Values.target.ray.worker.gpusPerWorker) -}}
{{- end -}}
{{- if and (eq .Values.target.executor "ray") (ne .Values.device "cuda") -}}
{{- fail "target.executor ray spreads ranks over GPU nodes: it needs device cuda" -}}
{{- end -}}
{{- end -}}

{{/* A settings value as the string SPECD_<NAME> holds; whole numbers stay whole (no 1e+06). */}}
{{- define "specd.envValue" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* ConfigMap data shared by the services plus a component's settings. Call with (list $ .Values.draft.settings). */}}
{{- define "specd.configData" -}}
{{- $root := index . 0 -}}
SPECD_LOG_LEVEL: {{ $root.Values.logLevel | quote }}
{{- with include "specd.otlpEndpoint" $root }}
SPECD_OTLP_ENDPOINT: {{ . | quote }}
{{- end }}
SPECD_OTLP_PROTOCOL: {{ $root.Values.telemetry.otlpProtocol | quote }}
SPECD_TRACE_SAMPLE_RATIO: {{ include "specd.envValue" $root.Values.telemetry.traceSampleRatio | quote }}
{{- range $key, $value := index . 1 }}
{{ printf "SPECD_%s" (upper $key) }}: {{ include "specd.envValue" $value | quote }}
{{- end }}
{{- end -}}

{{/* Arguments every service takes after `specd serve <name>`. Call with (list $ port). */}}
{{- define "specd.serverArgs" -}}
{{- $root := index . 0 -}}
- --host=0.0.0.0
- --port={{ index . 1 }}
{{- if $root.Values.metrics.enabled }}
- --metrics-port={{ $root.Values.metrics.port }}
{{- end }}
- --cache-dir={{ $root.Values.models.path }}
{{- end -}}

{{/* Server TLS of draft and target: their certificate, and mutual TLS with the coordinator's client CA. */}}
{{- define "specd.peerServerTlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/specd/tls/tls.crt
- --tls-key=/etc/specd/tls/tls.key
- --tls-client-ca=/etc/specd/client-ca/ca.crt
- --tls-client-names={{ include "specd.coordinatorClientName" . }}
{{- end }}
{{- end -}}

{{/* The name draft and target require in a client certificate: the coordinator's (its CN). */}}
{{- define "specd.coordinatorClientName" -}}
{{- .Values.tls.clientName | default (include "specd.componentName" (list . "coordinator")) -}}
{{- end -}}

{{/* Probes: native gRPC health checks without TLS; with TLS a TCP check (kubelet's gRPC probe cannot do TLS). Call with (list $ port failureThreshold). */}}
{{- define "specd.probes" -}}
{{- $root := index . 0 -}}
{{- $port := index . 1 -}}
{{- $check := dict "grpc" (dict "port" $port) -}}
{{- if $root.Values.tls.enabled -}}
{{- $check = dict "tcpSocket" (dict "port" "grpc") -}}
{{- end -}}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  failureThreshold: {{ index . 2 }}
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}

{{/* Container ports: grpc and metrics. Call with (list $ port). */}}
{{- define "specd.containerPorts" -}}
{{- $root := index . 0 -}}
- name: grpc
  containerPort: {{ index . 1 }}
  protocol: TCP
{{- if $root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ $root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Service ports: grpc and metrics. Call with (list $ port). */}}
{{- define "specd.servicePorts" -}}
{{- $root := index . 0 -}}
- name: grpc
  port: {{ index . 1 }}
  targetPort: grpc
  protocol: TCP
  appProtocol: grpc
{{- if $root.Values.metrics.enabled }}
- name: metrics
  port: {{ $root.Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Pod annotations: config checksum, Prometheus scrape hints, extras. Call with (list $ configTemplateName podAnnotations). */}}
{{- define "specd.podAnnotations" -}}
{{- $root := index . 0 -}}
checksum/config: {{ include (print $root.Template.BasePath "/" (index . 1)) $root | sha256sum }}
{{- if and $root.Values.metrics.enabled $root.Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $root.Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with index . 2 }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings every specd pod shares. */}}
{{- define "specd.podCommon" -}}
serviceAccountName: {{ include "specd.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Environment of specd containers: pod identity for traces, HOME and caches on the writable /tmp, offline model loading. */}}
{{- define "specd.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
# Tells pods apart in the traces.
- name: OTEL_RESOURCE_ATTRIBUTES
  value: k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/hf
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
- name: SPECD_CACHE_DIR
  value: {{ .Values.models.path | quote }}
{{- end -}}

{{/* Volume mounts of specd containers. Call with (list $ "server"|"coordinator"|"plain" shm). */}}
{{- define "specd.volumeMounts" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
- name: tmp
  mountPath: /tmp
{{- if index . 2 }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- if $root.Values.models.existingClaim }}
- name: models
  mountPath: {{ $root.Values.models.path }}
  readOnly: true
{{- end }}
{{- if and $root.Values.tls.enabled (ne $role "plain") }}
- name: tls
  mountPath: /etc/specd/tls
  readOnly: true
{{- if eq $role "coordinator" }}
- name: client-tls
  mountPath: /etc/specd/client-tls
  readOnly: true
{{- else }}
- name: client-ca
  mountPath: /etc/specd/client-ca
  readOnly: true
{{- end }}
{{- end }}
{{- if and (eq $role "coordinator") $root.Values.apiToken.enabled }}
- name: api-token
  mountPath: /etc/specd/api-token
  readOnly: true
{{- end }}
{{- end -}}

{{/* Volumes matching specd.volumeMounts. Call with (list $ role shm). */}}
{{- define "specd.volumes" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
- name: tmp
  emptyDir:
    sizeLimit: 2Gi
{{- if index . 2 }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $root.Values.target.shmSize }}
{{- end }}
{{- if $root.Values.models.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $root.Values.models.existingClaim }}
    readOnly: true
{{- end }}
{{- if and $root.Values.tls.enabled (ne $role "plain") }}
- name: tls
  secret:
    secretName: {{ include "specd.tlsSecret" $root }}
    defaultMode: 0440
{{- if eq $role "coordinator" }}
- name: client-tls
  secret:
    secretName: {{ include "specd.clientTlsSecret" $root }}
    defaultMode: 0440
{{- else }}
- name: client-ca
  secret:
    secretName: {{ include "specd.clientTlsSecret" $root }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}
{{- if and (eq $role "coordinator") $root.Values.apiToken.enabled }}
- name: api-token
  secret:
    secretName: {{ include "specd.apiTokenSecret" $root }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.apiToken.key }}
        path: token
{{- end }}
{{- end -}}

{{/* nvidia.com/gpu added to a resources block. Call with (list resources gpus). */}}
{{- define "specd.gpuResources" -}}
{{- $res := deepCopy (index . 0) -}}
{{- $gpus := int (index . 1) -}}
{{- if gt $gpus 0 -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" $gpus -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* A Kubernetes memory quantity ("4Gi", "512M", "1000") in bytes. */}}
{{- define "specd.bytes" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9.]+" $q | float64 -}}
{{- $unit := regexReplaceAll "^[0-9.]+" $q "" -}}
{{- $mult := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if not (hasKey $mult $unit) -}}
{{- fail (printf "cannot read the memory quantity %q (use Ki, Mi, Gi, Ti, k, M, G or T)" $q) -}}
{{- end -}}
{{- mulf $num (index $mult $unit) | int64 -}}
{{- end -}}

{{/* A model service's settings, with max_kv_bytes derived from its pod memory limit when it runs
on CPU and sets none (the KV cache then lives in pod memory). Call with (list $ .Values.target). */}}
{{- define "specd.modelSettings" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $settings := deepCopy ($component.settings | default dict) -}}
{{- $limit := dig "limits" "memory" "" ($component.resources | default dict) -}}
{{- if and (eq $root.Values.device "cpu") (not (hasKey $settings "max_kv_bytes")) $limit (gt (float64 $component.kvMemoryFraction) 0.0) -}}
{{- $_ := set $settings "max_kv_bytes" (mulf (include "specd.bytes" $limit | float64) $component.kvMemoryFraction | int64) -}}
{{- end -}}
{{- toYaml $settings -}}
{{- end -}}
