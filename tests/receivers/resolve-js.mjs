// @parca/client's ES modules import their siblings without the ".js" extension, which
// Node's ESM resolver refuses; this resolve hook retries such imports with ".js".
import { register } from "node:module";

if (!globalThis.__firnHookRegistered) {
    globalThis.__firnHookRegistered = true;
    register(import.meta.url);
}

export async function resolve(specifier, context, next) {
    try {
        return await next(specifier, context);
    } catch (e) {
        if (e?.code === "ERR_MODULE_NOT_FOUND" && specifier.startsWith(".") && !specifier.endsWith(".js")) {
            return next(specifier + ".js", context);
        }
        throw e;
    }
}
