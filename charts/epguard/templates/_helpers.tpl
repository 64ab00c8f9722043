{{/* Chart name, overridable. */}}
{{- define "epguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object-name prefix: "epguard" for a release named like the chart. */}}
{{- define "epguard.fullname" -}}
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

{{- define "epguard.webhookName" -}}{{ include "epguard.fullname" . | trunc 55 | trimSuffix "-" }}-webhook{{- end -}}
{{- define "epguard.controllerName" -}}{{ include "epguard.fullname" . | trunc 52 | trimSuffix "-" }}-controller{{- end -}}
{{/* The mutating configuration the injection feature adds; the controller keeps its caBundle. */}}
{{- define "epguard.mutatingName" -}}{{ include "epguard.fullname" . | trunc 56 | trimSuffix "-" }}-inject{{- end -}}
{{- define "epguard.rulesConfigMap" -}}epguard-rules{{- end -}}
{{- /* The Secret with the keys that sign injected probes (the controller creates it). */ -}}
{{- define "epguard.probeKeySecret" -}}{{ include "epguard.fullname" . | trunc 53 | trimSuffix "-" }}-probe-key{{- end -}}
{{- /* The outage backstop's name: its ValidatingAdmissionPolicy, with -enforce/-warn/-audit
its bindings, and the label value of its parameter shards (webhook/controller/compiler.py). */ -}}
{{- define "epguard.backstopName" -}}{{ include "epguard.fullname" . | trunc 46 | trimSuffix "-" }}-backstop{{- end -}}
{{- /* "true" when the backstop is on: asked for, and the API server serves the v1 API
and the 1.34 CEL list library its expressions use. Against a cluster, helm's
capabilities list every served kind; an offline render (`helm template`) knows only
group/versions (no kind at all, not even apps/v1/Deployment), so there the group/version
and the Kubernetes version decide. */ -}}
{{- define "epguard.backstopOn" -}}
{{- if and .Values.backstop.enabled (eq (include "epguard.vapServed" .) "true") (semverCompare ">=1.34-0" .Capabilities.KubeVersion.Version) -}}true{{- end -}}
{{- end -}}
{{- /* "true" when the API server serves admissionregistration.k8s.io/v1
ValidatingAdmissionPolicy (GA in 1.30); offline, the group/version and the version do. */ -}}
{{- define "epguard.vapServed" -}}
{{- $api := .Capabilities.APIVersions -}}
{{- if or ($api.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (and ($api.Has "admissionregistration.k8s.io/v1") (not ($api.Has "apps/v1/Deployment")) (semverCompare ">=1.30-0" .Capabilities.KubeVersion.Version)) -}}true{{- end -}}
{{- end -}}
{{- /* The ValidatingAdmissionPolicy that holds the controller to preflight pods and the gate. */ -}}
{{- /* The probe-copy command as webhook/engine/injection.py writes it (a chart test
checks they agree): the policy pins what a preflight's copy container runs. */ -}}
{{- define "epguard.preflightCopyCommand" -}}
['python3', '-c', 'import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True)', '/opt/epguard/probe', '/epguard/probe']
{{- end -}}
{{- define "epguard.preflightPolicyName" -}}{{ include "epguard.fullname" . | trunc 53 | trimSuffix "-" }}-preflight{{- end -}}
{{- /* The ClusterRole, binding and policy that let scanRecorder.serviceAccounts record. */ -}}
{{- define "epguard.scanRecorderName" -}}{{ include "epguard.fullname" . | trunc 49 | trimSuffix "-" }}-scan-recorder{{- end -}}

{{- define "epguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "epguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: epguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component (webhook, controller, helm-test). */}}
{{- define "epguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epguard.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "epguard.componentLabels" -}}
{{ include "epguard.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "epguard.image" -}}
{{- $img := .Values.image -}}
{{- $ref := printf "%s/%s" $img.registry $img.repository | trimPrefix "/" -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $ref $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{- define "epguard.webhookServiceAccount" -}}
{{- default (include "epguard.webhookName" .) .Values.webhook.serviceAccount.name -}}
{{- end -}}
{{- define "epguard.controllerServiceAccount" -}}
{{- default (include "epguard.controllerName" .) .Values.controller.serviceAccount.name -}}
{{- end -}}

{{/* A securityContext dict without null entries (null means "let the platform choose"). */}}
{{- define "epguard.compact" -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Preferred (not required) spreading over nodes, when no affinity is given. */}}
{{- define "epguard.defaultAffinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "epguard.selectorLabels" . | nindent 12 }}
{{- end -}}

{{/*
CEL for matchConditions: a prefilter, short enough to read in
`kubectl get validatingwebhookconfiguration epguard -o yaml`. An object is sent to epguard
when a string in one of its containers -- a command or args word, or a literal env value
-- mentions --el: the shortest spelling of --elastic-ep-backend that some SGLang release
accepts (tests/chart derives it from SGLang's option table, probe/cmdline.py). The
webhook itself decides what the mention means; the prefilter only keeps every other
object away from it, and may send a few objects it then lets through (`--elasticsearch-url`,
`--else`), never fewer than the flag.

Each string is tested as the webhook's own cheap test does (cmdline.mentions_flag):
it contains --el, or -- only when it holds a quote or a backslash ("[\x27\x22\\\\]":
' " \) -- the regular expression `-\W*-\W*e\W*l` (the letters of --el with any non-word
characters between them) matches it. So a flag a shell joins from quoted pieces
(`-''-elastic-ep-backend`, `--el"astic"-ep-backend`, `\--elastic-ep-backend` inside
`sh -c`, which probe/shell.py reads as the flag) is sent too. `=`-joined flags,
prefixes, `sh -c` scripts and `$(VAR)` references to literal env values all hold --el
somewhere CEL reads. What CEL cannot read -- a flag assembled from variables at run time
(`--ela$REST`), `$'\x2d…'` escapes, a `valueFrom` variable, a --config file -- never
reaches epguard: /mutate is sent by the same condition, so no probe is injected either
(docs/cmdline.md, "What admission cannot see").

Cost: every call is linear in the string (RE2), and the quote test keeps the regular
expression off strings without quotes, so no string costs more of the API server's CEL
budget than under the exact needle this replaced: measured on kube-apiserver 1.35, a
string full of quotes exceeds the per-call limit somewhere between 1.3 and 1.5 MB
(between 1.0 and 1.3 MB before), and failurePolicy decides; a string without quotes is
read up to the 3 MB request limit.

The expression uses only double-quoted CEL strings, so the YAML renders it single-quoted
and kubectl prints it verbatim.
*/}}
{{- define "epguard.cel.needle" -}}--el{{- end -}}
{{- define "epguard.cel.needlePattern" -}}
{{- splitList "" (include "epguard.cel.needle" .) | join "\\W*" -}}
{{- end -}}

{{/*
The nodes an object's paths reach, as CEL: a list of them, nested .d deep (CEL before
Kubernetes 1.34 has no flatten(), so each `[]`/`*` step that is not the last of its path
adds a level). Returned as JSON {g: guards, b: body, d: depth}: the body is a list when
the has() guards hold. The paths (.lists, each a list of segments: a field, `name[]` for
every item of a list, `*` for every value of a map -- webhook/engine/workloads.py
TemplatePath) are walked as a tree, so a shared prefix is guarded once. .var is the CEL
expression walked so far, .depth names the loop variables.
*/}}
{{- define "epguard.cel.nodes" -}}
{{- $var := .var -}}
{{- $depth := int .depth -}}
{{- $x := printf "x%d" $depth -}}
{{- $order := list -}}
{{- $groups := dict -}}
{{- range .lists -}}
{{- $key := "" -}}
{{- $rest := list -}}
{{- if . -}}{{- $key = first . -}}{{- $rest = rest . -}}{{- end -}}
{{- if not (hasKey $groups $key) -}}
{{- $order = append $order $key -}}
{{- $_ := set $groups $key list -}}
{{- end -}}
{{- $_ := set $groups $key (append (get $groups $key) $rest) -}}
{{- end -}}
{{- $pieces := list -}}
{{- range $key := $order -}}
{{- $rests := get $groups $key -}}
{{- $last := and (eq (len $rests) 1) (not (first $rests)) -}}
{{- if eq $key "" -}}
{{- $pieces = append $pieces (dict "g" list "b" (printf "[%s]" $var) "d" 1) -}}
{{- else if or (eq $key "*") (hasSuffix "[]" $key) -}}
{{- $items := printf "%s.map(k%d, %s[k%d])" $var $depth $var $depth -}}
{{- $guards := list -}}
{{- if ne $key "*" -}}
{{- $items = printf "%s.%s" $var (trimSuffix "[]" $key) -}}
{{- $guards = list (printf "has(%s)" $items) -}}
{{- end -}}
{{- if $last -}}
{{- $pieces = append $pieces (dict "g" $guards "b" $items "d" 1) -}}
{{- else -}}
{{- $sub := include "epguard.cel.nodes" (dict "var" $x "lists" $rests "depth" (add1 $depth)) | fromJson -}}
{{- $pieces = append $pieces (dict "g" $guards "b" (printf "%s.map(%s, %s)" $items $x (include "epguard.cel.guarded" $sub)) "d" (add1 (int $sub.d))) -}}
{{- end -}}
{{- else -}}
{{- $field := printf "%s.%s" $var $key -}}
{{- $sub := include "epguard.cel.nodes" (dict "var" $field "lists" $rests "depth" $depth) | fromJson -}}
{{- $pieces = append $pieces (dict "g" (prepend $sub.g (printf "has(%s)" $field)) "b" $sub.b "d" (int $sub.d)) -}}
{{- end -}}
{{- end -}}
{{- if eq (len $pieces) 1 -}}
{{- first $pieces | toJson -}}
{{- else -}}
{{- $d := 1 -}}
{{- range $pieces -}}{{- $d = max $d (int .d) -}}{{- end -}}
{{- $parts := list -}}
{{- range $pieces -}}
{{- $pad := sub $d (int .d) | int -}}
{{- $parts = append $parts (printf "%s%s%s" (repeat $pad "[") (include "epguard.cel.guarded" .) (repeat $pad "]")) -}}
{{- end -}}
{{- dict "g" list "b" (join " + " $parts) "d" $d | toJson -}}
{{- end -}}
{{- end -}}

{{/* A piece of epguard.cel.nodes as CEL: its body, or the empty list where a guard fails. */}}
{{- define "epguard.cel.guarded" -}}
{{- if .g -}}({{ join " && " .g }} ? {{ .b }} : []){{- else -}}{{ .b }}{{- end -}}
{{- end -}}

{{/*
CEL: an object of a kind described by paths (.kind: templates, podSpecs, containers,
as webhook/engine/workloads.py and webhook.extraKinds describe them) has a container
string that mentions the needle. Each node reached is read as a pod spec and as a
container at once: its containers and initContainers (and, for a Pod, .kind.ephemeral:
its ephemeralContainers, which `kubectl debug` adds through pods/ephemeralcontainers),
and itself (a pod spec has no command, a container no containers), then each container's command, args and literal
env values. Every step is guarded by has(), so an object of another shape (or with
fields missing) is false, never an error: an error would apply failurePolicy to it.
*/}}
{{- define "epguard.cel.kind" -}}
{{- $lists := list -}}
{{- range (.kind.templates | default list) -}}
{{- $lists = append $lists (append (splitList "." .) "spec") -}}
{{- end -}}
{{- range concat (.kind.podSpecs | default list) (.kind.containers | default list) -}}
{{- $lists = append $lists (splitList "." .) -}}
{{- end -}}
{{- $nodes := include "epguard.cel.nodes" (dict "var" "object" "lists" $lists "depth" 0) | fromJson -}}
{{- $d := int $nodes.d -}}
{{- include "epguard.cel.guarded" $nodes -}}
{{- range $i := untilStep (sub $d 1 | int) 0 -1 -}}.exists(l{{ $i }}, l{{ $i }}{{- end -}}
.exists(p, ([p] + (has(p.containers) ? p.containers : []) + (has(p.initContainers) ? p.initContainers : []){{ if .kind.ephemeral }} + (has(p.ephemeralContainers) ? p.ephemeralContainers : []){{ end }})
{{- /**/ -}}.exists(c, ((has(c.command) ? c.command : []) + (has(c.args) ? c.args : []) + (has(c.env) ? c.env.map(e, has(e.value) ? e.value : "") : []))
{{- /**/ -}}.exists(s, string(s).contains("{{ include "epguard.cel.needle" . }}") || string(s).matches("[\x27\x22\\\\]") && string(s).matches(r"{{ include "epguard.cel.needlePattern" . }}"))))
{{- repeat (sub $d 1 | int) ")" -}}
{{- end -}}

{{/* A string as a YAML scalar: single-quoted (nothing escaped, so a CEL expression
reads as written) unless it holds a single quote. */}}
{{- define "epguard.yamlString" -}}
{{- if contains "'" . -}}{{ quote . }}{{- else -}}{{ squote . }}{{- end -}}
{{- end -}}

{{/*
CEL: a pod carries epguard's own label or signature: the label that puts it on the
lists the controller reads each pass (epguard.io/probed: every preflight and every
gated worker has it) or the probe's signature annotation. Such a pod is sent to
/validate whether or not it mentions the flag, and refused there unless epguard signed
it (webhook/engine/signing.py parts_of): a tenant cannot put pods of its own on those
lists. The names are webhook/engine/outcome.py PROBED_LABEL and signing.py
SIGNATURE_ANNOTATION (tests/chart/test_match_conditions.py checks).
*/}}
{{- define "epguard.cel.epguardParts" -}}
has(object.metadata.labels) && "epguard.io/probed" in object.metadata.labels || has(object.metadata.annotations) && "epguard.io/probe-signature" in object.metadata.annotations
{{- end -}}

{{/* CEL: a Pod (object.spec) mentions the needle. The pods webhook of the validating
configuration and both webhooks of the mutating one use exactly this text. */}}
{{- define "epguard.cel.pod" -}}
{{ include "epguard.cel.kind" (dict "kind" (dict "podSpecs" (list "spec") "ephemeral" true)) }}
{{- end -}}

{{/* The values of epguard.io/inject that opt in, on a namespace label or a pod annotation
(webhook/engine/namespaces.py INJECT_ON; tests/chart asserts they agree). */}}
{{- define "epguard.injectValues" -}}["enabled", "true"]{{- end -}}

{{/* CEL: the Pod carries the opt-in annotation epguard.io/inject (see injectValues).
Guarded, so a pod without annotations is false, never an error. */}}
{{- define "epguard.cel.injectAnnotation" -}}
has(object.metadata) && has(object.metadata.annotations) && 'epguard.io/inject' in object.metadata.annotations && object.metadata.annotations['epguard.io/inject'] in {{ include "epguard.injectValues" . }}
{{- end -}}

{{/* The names of the namespaces in epguard.namespaceExclusions, as a JSON list (which is
also a CEL list literal). */}}
{{- define "epguard.excludedNamespaceNames" -}}
{{- concat (list "kube-system" .Release.Namespace) .Values.webhook.excludeNamespaces | uniq | toJson -}}
{{- end -}}

{{/* Namespaces no webhook of epguard is ever called for: kube-system, the release namespace,
webhook.excludeNamespaces, and any namespace labelled epguard.io/ignore=true. A list of
LabelSelectorRequirements (matchExpressions). */}}
{{- define "epguard.namespaceExclusions" -}}
- key: kubernetes.io/metadata.name
  operator: NotIn
  values: {{ include "epguard.excludedNamespaceNames" . }}
- key: epguard.io/ignore
  operator: NotIn
  values: ["true"]
{{- end -}}

{{/* Annotations of both webhook configurations: webhook.annotations, plus cainjector's
when cert-manager provides the TLS. */}}
{{- define "epguard.webhookConfigAnnotations" -}}
{{- $annotations := deepCopy .Values.webhook.annotations -}}
{{- if .Values.tls.certManager.enabled -}}
{{- $_ := set $annotations "cert-manager.io/inject-ca-from" (printf "%s/%s" .Release.Namespace (include "epguard.webhookName" .)) -}}
{{- end -}}
{{- with $annotations -}}
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{/* The probe-copy image of injection: injection.image, else the chart's own image. */}}
{{- define "epguard.injectImage" -}}
{{- default (include "epguard.image" .) .Values.injection.image -}}
{{- end -}}

{{/* A container's env: .env (the chart's own, YAML text) followed by .extra (a values list).
An extra variable that the chart already sets fails the render: a duplicate name would
shadow or be shadowed depending on the tool (the kubelet takes the last, server-side
apply refuses the duplicate key), so the value's own setting is the one place for it. */}}
{{- define "epguard.envWithExtra" -}}
{{- $env := fromYamlArray .env -}}
{{- $names := list -}}
{{- range $env -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- range .extra -}}
{{- if has .name $names -}}
{{- fail (printf "%s sets %s, which the chart already sets from its values: set the value instead (see values.yaml)" $.what .name) -}}
{{- end -}}
{{- end -}}
{{- toYaml (concat $env .extra) -}}
{{- end -}}

{{/*
A PodDisruptionBudget's minAvailable, refused where it keeps every replica up (an integer
at or above replicaCount, or a percentage that rounds up to it, as the disruption
controller rounds it): no node that holds a replica could ever be drained.
Call with (dict "pdb" <values> "replicas" <replicaCount> "what" "webhook").
*/}}
{{- define "epguard.minAvailable" -}}
{{- $min := .pdb.minAvailable -}}
{{- $replicas := int .replicas -}}
{{- $kept := 0 -}}
{{- if kindIs "string" $min -}}
{{- $kept = int (ceil (divf (mulf (float64 (trimSuffix "%" $min)) $replicas) 100)) -}}
{{- else -}}
{{- $kept = int $min -}}
{{- end -}}
{{- if ge $kept $replicas -}}
{{- fail (printf "%s.podDisruptionBudget.minAvailable %v keeps all %d replicas up, so no node that runs one could ever be drained: set it below %s.replicaCount, or disable the PodDisruptionBudget" .what $min $replicas .what) -}}
{{- end -}}
{{- $min -}}
{{- end -}}
