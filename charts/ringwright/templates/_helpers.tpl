{{/* Names and labels shared by every template. */}}

{{- define "ringwright.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; object names derive from it (63: a label value's limit). */}}
{{- define "ringwright.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ringwright.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ringwright.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ringwright.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ringwright.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ringwright
{{- end }}

{{- define "ringwright.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ringwright.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image: [registry/]repository, then @digest when one is set (a digest
names one image for good; a tag can be moved), else :tag (default: appVersion).
*/}}
{{- define "ringwright.image" -}}
{{- $image := .Values.image }}
{{- $name := $image.repository }}
{{- with $image.registry }}
{{- $name = printf "%s/%s" . $name }}
{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $name $image.digest }}
{{- else }}
{{- printf "%s:%s" $name (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* imagePullSecrets entries: a Secret's name, or a {name: ...} reference. */}}
{{- define "ringwright.imagePullSecrets" -}}
{{- range . }}
- name: {{ if kindIs "string" . }}{{ . }}{{ else }}{{ .name }}{{ end }}
{{- end }}
{{- end }}

{{/*
Cross-field checks the values schema cannot express. Every template includes
this, so `helm template`, `helm lint` and `helm install` all refuse bad values.
*/}}
{{- define "ringwright.validate" -}}
{{- $pc := .Values.priorityClasses }}
{{- if le (int64 $pc.ps.value) (int64 $pc.worker.value) }}
{{- fail (printf "priorityClasses.ps.value (%v) must be greater than priorityClasses.worker.value (%v): parameter servers must outrank workers" $pc.ps.value $pc.worker.value) }}
{{- end }}
{{- if eq $pc.ps.name $pc.worker.name }}
{{- fail (printf "priorityClasses.ps.name and priorityClasses.worker.name must differ (both are %q)" $pc.ps.name) }}
{{- end }}
{{- $labels := .Values.schedulingPolicy.nodeLabels }}
{{- if or (eq $labels.rack $labels.nvlinkDomain) (eq $labels.rack $labels.gpuModel) (eq $labels.nvlinkDomain $labels.gpuModel) }}
{{- fail "schedulingPolicy.nodeLabels.rack, .nvlinkDomain and .gpuModel must be three different label keys" }}
{{- end }}
{{- end }}

{{- /* The rules of <fullname>-jobs (rbac.yaml): a ClusterRole, or a Role per watched namespace. */}}
{{- define "ringwright.jobRules" }}
  # The jobs: kopf lists, watches and patches them (finalizers, progress), the
  # operator applies status and deletes a job once ttlSecondsAfterFinished passes.
  - apiGroups: [ringwright.dev]
    resources: [trainingjobs]
    verbs: [list, watch, patch, delete]
  - apiGroups: [ringwright.dev]
    resources: [trainingjobs/status]
    verbs: [patch]
  # Worker and ps pods: created, marked as leaving, deleted.
  - apiGroups: [""]
    resources: [pods]
    verbs: [create, delete, patch]
  # World and reports ConfigMaps: applied, watched, reports cleared. `get` is
  # only held so the per-job Role may grant it on the world ConfigMap.
  - apiGroups: [""]
    resources: [configmaps]
    verbs: [get, list, watch, create, patch]
  # Per job, applied: the headless Service, the pods' ServiceAccount, its Role and
  # RoleBinding, the NetworkPolicy. Watched (label-selected) so that each round
  # repairs drift from the cache instead of re-applying them all.
  - apiGroups: [""]
    resources: [services, serviceaccounts]
    verbs: [list, watch, create, patch]
  - apiGroups: [rbac.authorization.k8s.io]
    resources: [roles, rolebindings]
    verbs: [list, watch, create, patch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [list, watch, create, patch]
  # Per job: the join-token Secret, created once and never read back.
  - apiGroups: [""]
    resources: [secrets]
    verbs: [create]
  # Events at every phase transition, and kopf's handler events.
  - apiGroups: [""]
    resources: [events]
    verbs: [create, patch]
  {{- if eq (toString (.Values.operator.settings.kueue | default false)) "true" }}
  # Kueue (settings.kueue): each queued job's Workload, created and watched; its
  # counts patched while it waits (and, with kueueElastic, its slices created, shrunk
  # and withdrawn); its status patched when the job ends (Finished, which frees the
  # quota) and when an evicted job's pods are gone (back to the queue).
  - apiGroups: [kueue.x-k8s.io]
    resources: [workloads]
    verbs: [list, watch, create, patch, delete]
  - apiGroups: [kueue.x-k8s.io]
    resources: [workloads/status]
    verbs: [patch]
  {{- end }}
{{- end }}
