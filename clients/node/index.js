'use strict';
/**
 * A small Node.js client for the asyncengine gRPC API (asyncengine.v1 Generation and Control,
 * plus the standard grpc.health.v1 Health service).
 *
 * The .proto files are loaded at runtime from the repository's protos/ folder, so this client can
 * never drift from the server's API: there is no generated or copied code to keep in sync.
 */

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROTO_DIR = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILES = ['asyncengine/v1/generation.proto', 'asyncengine/v1/control.proto'];

// camelCase fields, enums as names, every scalar present, the set member of a oneof named in a
// virtual field (`response.event === 'delta'`). uint64s (seeds, sequence numbers) come back as
// decimal strings because a Number would round seeds above 2^53.
const LOADER_OPTIONS = {
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

// The standard gRPC health service. It is not in protos/ (the server gets it from
// grpcio-health-checking), so it is described here instead of adding a dependency for 20 lines.
const HEALTH_PROTO = {
  nested: { grpc: { nested: { health: { nested: { v1: { nested: {
    HealthCheckRequest: { fields: { service: { type: 'string', id: 1 } } },
    HealthCheckResponse: {
      fields: { status: { type: 'ServingStatus', id: 1 } },
      nested: {
        ServingStatus: { values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 } },
      },
    },
    Health: {
      methods: {
        Check: { requestType: 'HealthCheckRequest', responseType: 'HealthCheckResponse' },
        Watch: {
          requestType: 'HealthCheckRequest',
          responseType: 'HealthCheckResponse',
          responseStream: true,
        },
      },
    },
  } } } } } } },
};

const packagesByDir = new Map();

/** The loaded gRPC packages for the .proto files under `protoDir` (cached per folder). */
function loadPackages(protoDir = DEFAULT_PROTO_DIR) {
  if (!packagesByDir.has(protoDir)) {
    const options = { ...LOADER_OPTIONS, includeDirs: [protoDir] };
    const definition = protoLoader.loadSync(PROTO_FILES, options);
    const health = protoLoader.fromJSON(HEALTH_PROTO, LOADER_OPTIONS);
    packagesByDir.set(protoDir, {
      asyncengine: grpc.loadPackageDefinition(definition).asyncengine.v1,
      health: grpc.loadPackageDefinition(health).grpc.health.v1,
    });
  }
  return packagesByDir.get(protoDir);
}

/** Channel credentials: plaintext unless `tls` is true (system roots) or `{ca, key, cert}`. */
function channelCredentials(tls) {
  if (!tls) return grpc.credentials.createInsecure();
  if (tls === true) return grpc.credentials.createSsl();
  return grpc.credentials.createSsl(tls.ca ?? null, tls.key ?? null, tls.cert ?? null);
}

/** A string prompt is shorthand for `{text}`. */
function asPrompt(prompt) {
  return typeof prompt === 'string' ? { text: prompt } : prompt;
}

/**
 * Connect to an asyncengine server.
 *
 * @param {string} target  `host:port` (or any gRPC target such as `unix:/path`).
 * @param {object} [options]
 * @param {string} [options.token]  Sent as `authorization: Bearer <token>` on every call.
 * @param {string} [options.controlToken]  Sent instead of `token` on Control calls (for a server
 *   started with --control-auth-token).
 * @param {boolean|{ca?: Buffer, key?: Buffer, cert?: Buffer}} [options.tls]  Off by default.
 * @param {string} [options.protoDir]  Where asyncengine/v1/*.proto live (default: ../../protos).
 * @param {object} [options.channelOptions]  For grpc-js (`grpc.max_receive_message_length`, ...).
 */
function createClient(target, { token, controlToken = token, tls, protoDir, channelOptions } = {}) {
  const { asyncengine, health } = loadPackages(protoDir);
  const credentials = channelCredentials(tls);
  // One channel shared by the three stubs.
  const generation = new asyncengine.Generation(target, credentials, channelOptions);
  const shared = { channelOverride: generation.getChannel() };
  const control = new asyncengine.Control(target, credentials, shared);
  const healthStub = new health.Health(target, credentials, shared);

  // Per-call metadata rather than call credentials: grpc-js refuses call credentials on a
  // plaintext channel, and a token over plaintext is still useful behind a TLS-terminating proxy.
  function callArgs({ timeoutMs, metadata } = {}, bearer = token) {
    const md = metadata instanceof grpc.Metadata ? metadata.clone() : new grpc.Metadata();
    if (bearer) md.set('authorization', `Bearer ${bearer}`);
    const options = timeoutMs == null ? {} : { deadline: Date.now() + timeoutMs };
    return [md, options];
  }

  function onAbort(signal, call) {
    if (!signal) return;
    if (signal.aborted) call.cancel();
    else signal.addEventListener('abort', () => call.cancel(), { once: true });
  }

  function unary(stub, method, request, callOptions = {}) {
    return new Promise((resolve, reject) => {
      const bearer = stub === control ? controlToken : token;
      const call = stub[method](request, ...callArgs(callOptions, bearer), (err, response) =>
        err ? reject(err) : resolve(response),
      );
      onAbort(callOptions.signal, call);
    });
  }

  return {
    /**
     * Stream one request. Returns the grpc-js call: an async iterable and an event emitter
     * ('data', 'error', 'end', 'status') of GenerateResponse messages, each with `event` naming
     * its kind ('accepted', 'delta', 'heartbeat', 'finished', 'usage') and that field set.
     * `call.cancel()` (or aborting `signal`) ends the request on the server too; the stream then
     * fails with code CANCELLED.
     */
    generateStream(request, callOptions = {}) {
      const call = generation.GenerateStream(asPrompt(request), ...callArgs(callOptions));
      onAbort(callOptions.signal, call);
      return call;
    },
    /** Many prompts, one parameter set; `prompts` may hold strings. Resolves to `{results}`. */
    generate(request, callOptions) {
      const prompts = (request.prompts ?? []).map(asPrompt);
      return unary(generation, 'Generate', { ...request, prompts }, callOptions);
    },
    /** `{texts, addSpecialTokens?, returnTokens?, returnOffsets?, truncate?}` → `{results}`. */
    tokenize(request, callOptions) {
      return unary(generation, 'Tokenize', request, callOptions);
    },
    /** `{sequences: [{ids}], skipSpecialTokens?}` → `{texts}`. */
    detokenize(request, callOptions) {
      return unary(generation, 'Detokenize', request, callOptions);
    },
    /** Abort by id (a string, an array of them, or `{requestIds}`); resolves to `{abortedIds}`. */
    abort(ids, callOptions) {
      const isIds = typeof ids === 'string' || Array.isArray(ids);
      return unary(control, 'Abort', isIds ? { requestIds: [ids].flat() } : ids, callOptions);
    },
    modelInfo(callOptions) {
      return unary(control, 'GetModelInfo', {}, callOptions);
    },
    /** `{version, load: {running, waiting, swapped, ...}, uptimeS, draining}`. */
    serverInfo(callOptions) {
      return unary(control, 'GetServerInfo', {}, callOptions);
    },
    /** A stream of LoadReport every `intervalMs` (server default 1000). Cancel it to stop. */
    watchLoad({ intervalMs = 0 } = {}, callOptions = {}) {
      const call = control.WatchLoad({ intervalMs }, ...callArgs(callOptions, controlToken));
      onAbort(callOptions.signal, call);
      return call;
    },
    /** Stop admission and wait for in-flight requests; resolves to `{aborted}`. */
    drain({ gracePeriodMs = 0 } = {}, callOptions) {
      return unary(control, 'Drain', { gracePeriodMs }, callOptions);
    },
    /** Load a LoRA adapter (a PEFT directory on the server) as `loraName`; resolves to
     * `{loraName, loraId, loraPath, baseModelName}`. Needs --allow-runtime-lora-updating. */
    loadLoRA({ loraName, loraPath }, callOptions) {
      return unary(control, 'LoadLoRA', { loraName, loraPath }, callOptions);
    },
    /** Unload an adapter by name; FAILED_PRECONDITION while requests use it. `{adapter}`. */
    unloadLoRA(loraName, callOptions) {
      return unary(control, 'UnloadLoRA', { loraName }, callOptions);
    },
    /** The adapters served, in load order: `{adapters: [{loraName, loraId, ...}]}`. */
    listLoRAs(callOptions) {
      return unary(control, 'ListLoRAs', {}, callOptions);
    },
    /** The serving status of `service` ('' is the whole server): 'SERVING', 'NOT_SERVING', ... */
    async health(service = '', callOptions) {
      const response = await unary(healthStub, 'Check', { service }, callOptions);
      return response.status;
    },
    /** Resolve once the channel is connected (or reject after `timeoutMs`). */
    waitForReady(timeoutMs = 10_000) {
      return new Promise((resolve, reject) =>
        generation.waitForReady(Date.now() + timeoutMs, (err) => (err ? reject(err) : resolve())),
      );
    },
    close() {
      generation.close();
    },
  };
}

module.exports = { createClient, loadPackages, status: grpc.status, Metadata: grpc.Metadata };
